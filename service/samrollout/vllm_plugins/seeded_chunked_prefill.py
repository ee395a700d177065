"""Seeded requests survive chunked prefill on vLLM's CPU backend (a vLLM general plugin).

A step that prefills only part of a prompt still samples a token for that request, then
discards it.  So that a seeded request draws the same random numbers however its prompt
was chunked, vLLM rewinds the request's generator by the draws of that sample
(``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``).
That is a CUDA Philox offset: a CPU ``torch.Generator`` raises "CPU Generator does not use
offset", which killed the engine for every request the first time a seeded request's
prefill was chunked.  This is why the server used to turn chunked prefill off on CPU,
so that one long prompt prefilled in a single step that could starve every other request.

The patch undoes the discarded sample exactly on CPU generators instead: the state of each
such generator is saved before sampling and restored after it, and vLLM's rewind loop does
not see those generators.  A seeded request's tokens are then the same whether its prefill
was chunked or not (tested on the real engine).  CUDA and NPU generators keep vLLM's code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from samrollout.vllm_plugins.post_import import patch_on_import

logger = logging.getLogger("vllm.samrollout.vllm_plugins.seeded_chunked_prefill")
_TARGET_MODULE = "vllm.v1.worker.gpu_model_runner"
_TARGET_CLASS = "GPUModelRunner"


def _discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Row -> generator of the rows whose sample this step is thrown away (partial prefills), CPU only."""
    num_reqs = runner.input_batch.num_reqs
    mask = runner.discard_request_mask.np[:num_reqs]
    if not mask.any():
        return {}
    generators = runner.input_batch.generators
    chosen = {}
    for row in mask.nonzero()[0].tolist():
        generator = generators.get(row)
        if generator is not None and generator.device.type == "cpu":
            chosen[row] = generator
    return chosen


def sampling_without_discarded_draws(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_sample`` that leaves the generators of discarded rows as they were before it."""

    @functools.wraps(original)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {row: (generator, generator.get_state())
                 for row, generator in _discarded_cpu_generators(self).items()}
        try:
            return original(self, *args, **kwargs)
        finally:
            for generator, state in saved.values():
                generator.set_state(state)

    _sample.__samrollout_patched__ = True  # type: ignore[attr-defined]
    return _sample


@contextmanager
def _hidden(generators: dict[int, Any], rows: dict[int, Any]) -> Iterator[None]:
    """Take ``rows`` out of ``generators`` for the block (their draws were already undone)."""
    for row in rows:
        generators.pop(row, None)
    try:
        yield
    finally:
        generators.update(rows)


def bookkeeping_without_cpu_rewind(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_bookkeeping_sync`` whose offset rewind skips CPU generators (undone by `_sample` already)."""

    @functools.wraps(original)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        rows = _discarded_cpu_generators(self)
        if not rows:
            return original(self, *args, **kwargs)
        with _hidden(self.input_batch.generators, rows):
            return original(self, *args, **kwargs)

    _bookkeeping_sync.__samrollout_patched__ = True  # type: ignore[attr-defined]
    return _bookkeeping_sync


def patch(runner_class: Any) -> bool:
    """Wrap the runner's ``_sample`` and ``_bookkeeping_sync`` once; False if it lacks them."""
    for name, wrapper in (("_sample", sampling_without_discarded_draws),
                          ("_bookkeeping_sync", bookkeeping_without_cpu_rewind)):
        method = getattr(runner_class, name, None)
        if method is None:
            logger.warning("samrollout: %s has no %s; seeded chunked prefill on CPU not patched",
                           runner_class.__name__, name)
            return False
        if not getattr(method, "__samrollout_patched__", False):
            setattr(runner_class, name, wrapper(method))
    return True


def register() -> None:
    """vLLM general plugin entry point: on CPU, patch the model runner once vLLM imports it (never raises)."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            patch_on_import(_TARGET_MODULE, lambda module: patch(getattr(module, _TARGET_CLASS)),
                            "seeded requests whose prefill is chunked crash the CPU worker", logger)
    except Exception as exc:  # a plugin must not stop vLLM from starting
        logger.warning("samrollout: seeded chunked prefill not patched: %s", exc)
