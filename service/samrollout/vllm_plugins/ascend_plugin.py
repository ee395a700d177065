"""vLLM general plugin: lets vllm-ascend 0.23 run ``speculative_config={"method": "custom_class", ...}``.

vLLM (0.23 and later) builds a ``custom_class`` proposer in ``GPUModelRunner`` and calls
``drafter.propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu,
slot_mappings=...)`` after each step.  vllm-ascend 0.23's ``NPUModelRunner`` replaces both
places with its own code that only knows its proposers (ngram, suffix, eagle, mtp, ...):

- ``NPUModelRunner._get_drafter`` calls ``get_spec_decode_method(method, vllm_config, device,
  runner)``, which raises ``ValueError("Unknown speculative decoding method: custom_class")``;
- ``NPUModelRunner.propose_draft_token_ids`` dispatches on the proposer's class and raises the
  same error for any other proposer.

This plugin (entry point ``vllm.general_plugins: samrollout_ascend``) patches exactly these
two functions, and nothing else, for the vllm-ascend versions in `SUPPORTED`:

- ``get_spec_decode_method("custom_class", ...)`` returns the class named in
  ``speculative_config.model`` built like vLLM builds it (``cls(vllm_config)``), as a subclass
  that adds the calls the NPU runner makes on every proposer (`NpuDrafterHooks`): the object
  still is a ``SamProposer``, so ``samrollout.spec_decode.worker_extension`` finds it;
- ``propose_draft_token_ids`` calls that proposer the way vLLM's GPU runner does when the
  method is ``custom_class`` and defers to vllm-ascend's own code otherwise.

vLLM loads general plugins in every process (API server, engine core, workers) on every
platform.  `register` therefore only reads package metadata; without a supported
vllm-ascend it does nothing.  With one it installs an import hook, so the (heavy, NPU-only)
runner module is patched when vllm-ascend's worker imports it rather than imported here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from samrollout.vllm_plugins.post_import import PatchAfterImport as _PatchAfterImport  # noqa: F401  (tests find it on sys.meta_path)
from samrollout.vllm_plugins.post_import import patch_on_import

# A child of vLLM's logger, so the lines show up in vLLM's log (format, VLLM_LOGGING_LEVEL) in every process.
logger = logging.getLogger("vllm.samrollout.vllm_plugins.ascend_plugin")

# vllm-ascend version -> the vLLM version it is built for (vllm-ascend's docs, community/versioning_policy.md).
SUPPORTED: dict[str, str] = {"0.23.0": "0.23.0", "0.23.0.post1": "0.23.0"}

SPEC_DECODE_MODULE = "vllm_ascend.spec_decode"
RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
RUNNER_CLASS = "NPUModelRunner"
CUSTOM_CLASS = "custom_class"
_ORIGINAL = "__samrollout_original__"  # set on our wrappers: the function they wrap

_registered = False


class NpuDrafterHooks:
    """What vllm-ascend's NPU runner calls on every proposer, besides ``propose``.

    vLLM's GPU runner calls neither on a ``custom_class`` proposer; the NPU runner calls
    ``load_model(model)`` after loading the target model and ``dummy_run(num_tokens=...,
    ...)`` (keywords only) in each of its dummy runs (profiling, graph capture).  A model-free
    proposer has nothing to do in either; a class that defines them keeps its own.
    """

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load."""

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to run: no model, no graphs."""


@functools.cache
def npu_proposer_class(cls: type) -> type:
    """``cls`` with `NpuDrafterHooks` under it (its own methods win); instances still are ``cls``."""
    if issubclass(cls, NpuDrafterHooks):
        return cls
    return type(f"{cls.__name__}OnNPU", (cls, NpuDrafterHooks), {"__module__": __name__})


def load_custom_proposer(vllm_config: Any) -> Any:
    """The ``custom_class`` proposer for an NPU runner: vLLM's ``create_custom_proposer``, NPU-ready.

    Resolves ``speculative_config.model`` ("module.Class") and calls ``cls(vllm_config)`` as
    vLLM does (`SamProposer` then finds the runner on the call stack, ``NPUModelRunner._get_drafter``).
    """
    path = str(vllm_config.speculative_config.model or "")
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"custom_class proposer must be a full 'module.Class' path, got {path!r}")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not isinstance(cls, type):
        raise AttributeError(f"custom_class proposer {path!r}: {module_name} has no class {class_name!r}")
    proposer = npu_proposer_class(cls)(vllm_config)
    if not callable(getattr(proposer, "propose", None)):
        raise AttributeError(f"custom_class proposer {path!r} has no callable 'propose'")
    logger.info("Loaded custom_class proposer %s for the NPU runner", path)
    return proposer


def is_patched(function: Any) -> bool:
    """Whether ``function`` is one of this module's wrappers."""
    return getattr(function, _ORIGINAL, None) is not None


def wrap_get_spec_decode_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """vllm-ascend's ``get_spec_decode_method`` that also builds ``custom_class`` proposers."""
    if is_patched(original):
        return original

    @functools.wraps(original)
    def get_spec_decode_method(method: str, vllm_config: Any, device: Any, runner: Any) -> Any:
        if method == CUSTOM_CLASS:
            return load_custom_proposer(vllm_config)
        return original(method, vllm_config, device, runner)

    setattr(get_spec_decode_method, _ORIGINAL, original)
    return get_spec_decode_method


def patch_spec_decode_method(namespace: Any) -> bool:
    """Replace ``namespace.get_spec_decode_method`` (a module); False if it was patched already.

    Both ``vllm_ascend.spec_decode`` and the runner module need it: the runner module binds the
    function at import (``from vllm_ascend.spec_decode import get_spec_decode_method``) and
    ``_get_drafter`` looks it up in the runner module's globals.
    """
    original = namespace.get_spec_decode_method
    if is_patched(original):
        return False
    namespace.get_spec_decode_method = wrap_get_spec_decode_method(original)
    return True


def patch_model_runner(runner_cls: type) -> bool:
    """Wrap ``runner_cls.propose_draft_token_ids`` (defined on that class); False if patched already.

    For ``custom_class`` the wrapper makes the call vLLM's ``GPUModelRunner.propose_draft_token_ids``
    makes.  The NPU runner takes that path with ``valid_sampled_token_ids`` as a CPU
    ``list[list[int]]`` after ``_bookkeeping_sync`` appended them to ``input_batch.token_ids_cpu``
    and ``num_tokens_no_spec`` (the padded, tensor path is only for eagle/mtp/draft-model/ngram_gpu),
    so the arguments mean what they mean on GPU.  The NPU runner has no per-layer slot mappings
    there: ``slot_mappings=None``, which vLLM's model-free proposers ignore.
    """
    original = runner_cls.__dict__.get("propose_draft_token_ids")
    if original is None:
        raise AttributeError(f"{runner_cls.__qualname__} defines no propose_draft_token_ids")
    if is_patched(original):
        return False

    @functools.wraps(original)
    def propose_draft_token_ids(self: Any, valid_sampled_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        spec = self.speculative_config
        if spec is None or spec.method != CUSTOM_CLASS or not self.drafter:
            return original(self, valid_sampled_token_ids, *args, **kwargs)
        if not isinstance(valid_sampled_token_ids, list):
            raise TypeError("custom_class proposers take the sampled tokens as list[list[int]], "
                            f"got {type(valid_sampled_token_ids).__name__}")
        batch = self.input_batch
        return self.drafter.propose(valid_sampled_token_ids, batch.num_tokens_no_spec, batch.token_ids_cpu,
                                    slot_mappings=None)

    setattr(propose_draft_token_ids, _ORIGINAL, original)
    setattr(runner_cls, "propose_draft_token_ids", propose_draft_token_ids)  # noqa: B010 (a method, on purpose)
    return True


def apply_patches(runner_module: ModuleType) -> None:
    """Patch a freshly imported ``vllm_ascend.worker.model_runner_v1`` (and ``vllm_ascend.spec_decode``).

    Every target is looked up first, so a module without one of them is left entirely as it is.
    """
    runner_cls = getattr(runner_module, RUNNER_CLASS)
    if "propose_draft_token_ids" not in vars(runner_cls) or not callable(runner_module.get_spec_decode_method):
        raise AttributeError(f"{RUNNER_MODULE} is not laid out as in vllm-ascend 0.23")
    patch_spec_decode_method(runner_module)
    spec_decode = sys.modules.get(SPEC_DECODE_MODULE)
    if spec_decode is not None:
        patch_spec_decode_method(spec_decode)
    patch_model_runner(runner_cls)
    logger.info("samrollout: vllm-ascend's %s routes speculative method 'custom_class'", RUNNER_CLASS)


def unsupported_reason(ascend_version: str | None, vllm_version: str | None) -> str | None:
    """Why the plugin must stay off for these installed versions, or None when it applies."""
    if ascend_version is None:
        return "vllm-ascend is not installed"
    if ascend_version not in SUPPORTED:
        return f"vllm-ascend {ascend_version} is not a supported version ({', '.join(SUPPORTED)})"
    wanted = SUPPORTED[ascend_version]
    # vLLM built from source for Ascend (VLLM_TARGET_DEVICE=empty) may carry a local version, "0.23.0+empty".
    if vllm_version is None or vllm_version.split("+")[0] != wanted:
        return f"vllm-ascend {ascend_version} needs vLLM {wanted}, found {vllm_version}"
    return None


def installed_versions() -> tuple[str | None, str | None]:
    """(vllm-ascend, vLLM) versions from package metadata; no import.

    ``VLLM_VERSION`` overrides vLLM's, as it does for vllm-ascend itself (for dev builds).
    """

    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    ascend = version("vllm-ascend")
    if ascend is None:
        return None, None
    return ascend, os.environ.get("VLLM_VERSION") or version("vllm")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent, never raises, a no-op off Ascend."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        reason = unsupported_reason(*installed_versions())
        if reason is not None:
            log = logger.debug if reason == "vllm-ascend is not installed" else logger.info
            log("samrollout: Ascend plugin off: %s", reason)
            return
        patch_on_import(RUNNER_MODULE, apply_patches, "method 'custom_class' stays unavailable", logger)
    except Exception:
        logger.warning("samrollout: Ascend plugin failed to register", exc_info=True)
