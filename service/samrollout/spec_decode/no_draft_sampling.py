"""Skip vLLM's rejection sampling in steps where no request carries a draft (a vLLM general plugin).

With any speculative method configured, vLLM (0.32, 0.33) sends every step through its rejection
sampler, also when no request in the batch has a draft (SAM's threshold and CPU guard
make such steps the common case at large batch sizes).  There, `rejection_sample` only
places each request's bonus token, but first draws an exponential variate for every
(request, vocabulary entry) pair: on vLLM's CPU backend that was a third of the worker's
time on a sampled 128-request batch, and made a sampled rollout 50% slower with SAM on
than off although nothing was drafted.

It also crashed the engine: a request with ``top_k`` in such a step sent an empty
target-logits tensor through top-k filtering (``k.max()`` of an empty tensor), killing
the worker for every request.

The patch returns the bonus tokens directly when ``max_spec_len == 0``, and passes an
empty target-logits tensor through ``apply_sampling_constraints`` untouched.  Outputs are
unchanged: with no drafts every request's token is its bonus token, which vLLM's own
kernels copy the same way; seeded requests' generators are not touched by the skipped
code (vLLM draws from them only for requests with drafts), so seeded outputs are
identical; only the global generator, used by unseeded requests, is not advanced by the
skipped draw, which leaves their distribution unchanged.  Steps with drafts go to vLLM's
function as they are.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from samrollout.vllm_plugins.post_import import patch_on_import

logger = logging.getLogger("vllm.samrollout.no_draft_sampling")
_TARGET_MODULE = "vllm.v1.sample.rejection_sampler"
_PARAMETERS = ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
               "target_logits", "bonus_token_ids", "sampling_metadata")


def without_draftless_work(original: Callable[..., Any]) -> Callable[..., Any]:
    """``rejection_sample`` that answers steps without drafts itself and defers the rest to ``original``."""

    @functools.wraps(original)
    def rejection_sample(draft_token_ids: Any, num_draft_tokens: list[int], max_spec_len: int,
                         cu_num_draft_tokens: Any, draft_probs: Any, target_logits: Any, bonus_token_ids: Any,
                         sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        if max_spec_len == 0 and not kwargs.get("synthetic_mode", False):
            import torch

            # [batch_size, 1]: what vLLM's kernels write when no draft is accepted.
            return bonus_token_ids.to(torch.int32).reshape(len(num_draft_tokens), 1).clone()
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)

    rejection_sample.__samrollout_patched__ = True  # type: ignore[attr-defined]
    return rejection_sample


def skipping_empty_logits(original: Callable[..., Any]) -> Callable[..., Any]:
    """``apply_sampling_constraints`` that returns an empty (no draft positions) logits tensor as it is."""

    @functools.wraps(original)
    def apply_sampling_constraints(logits: Any, *args: Any, **kwargs: Any) -> Any:
        if logits.shape[0] == 0:
            return logits
        return original(logits, *args, **kwargs)

    apply_sampling_constraints.__samrollout_patched__ = True  # type: ignore[attr-defined]
    return apply_sampling_constraints


def patch(module: Any) -> bool:
    """Wrap ``module.rejection_sample`` and ``apply_sampling_constraints`` once; False if they look unexpected."""
    constraints = getattr(module, "apply_sampling_constraints", None)
    if constraints is not None and not getattr(constraints, "__samrollout_patched__", False):
        module.apply_sampling_constraints = skipping_empty_logits(constraints)
    original = getattr(module, "rejection_sample", None)
    if original is None:
        logger.warning("samrollout: %s has no rejection_sample; not patched", _TARGET_MODULE)
        return False
    if getattr(original, "__samrollout_patched__", False):
        return True
    names = tuple(inspect.signature(original).parameters)[:len(_PARAMETERS)]
    if names != _PARAMETERS:
        logger.warning("samrollout: %s.rejection_sample takes %s; not patched", _TARGET_MODULE, names)
        return False
    module.rejection_sample = without_draftless_work(original)
    return True


def register() -> None:
    """vLLM general plugin entry point: patch the rejection sampler once vLLM imports it (never raises)."""
    patch_on_import(_TARGET_MODULE, patch, "steps without drafts run vLLM's full rejection sampling", logger)
