"""The static threshold and the draft range as vLLM's own batch-size schedule of draft lengths (vLLM 0.32).

vLLM 0.32 has ``SpeculativeConfig.num_speculative_tokens_per_batch_size``: inclusive
(first batch size, last batch size, k) ranges that its scheduler expands into the number
of draft tokens to schedule at each batch size.  vLLM hands that number to its built-in
proposers but not to ``custom_class`` ones, so `SamProposer` reads the same schedule from
the engine's config and expands it with vLLM's own function: one source of truth, visible
in vLLM's config and logs.  vLLM 0.23 has no such field, and vLLM 0.33 drops the schedule
of every proposer that cannot take it on its V1 model runner, ``custom_class`` included
(with a warning; ``custom_class`` runs on no other runner): on both, no schedule is passed
and the proposer's `StaticGate` applies the same schedule itself (`dense_from_range`: drafts cut
to the schedule's length, none above its last batch size), with the same drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"


def vllm_has_batch_size_schedule() -> bool:
    """Whether the installed vLLM keeps a batch-size schedule for a ``custom_class`` proposer.

    0.32 does; 0.23 has no such field; 0.33 drops it (``VllmConfig._maybe_disable_dynamic_sd_for_v1``:
    on its V1 model runner only ngram, EAGLE, MTP, draft-model and DFlash proposers keep one).
    """
    from vllm.config import SpeculativeConfig, VllmConfig

    if SCHEDULE_FIELD not in {field.name for field in dataclasses.fields(SpeculativeConfig)}:
        return False
    return not hasattr(VllmConfig, "_maybe_disable_dynamic_sd_for_v1")


def range_schedule(draft_range: tuple[tuple[int, int], ...]) -> list[list[int]]:
    """A draft range ((up_to_running, k), ...) as vLLM's inclusive (first, last, k) ranges, none past the last."""
    schedule, first = [], 1
    for last, k in draft_range:
        schedule.append([first, last, k])
        first = last + 1
    return [*schedule, [first, first, 0]]


def dense_from_range(draft_range: tuple[tuple[int, int], ...]) -> list[int]:
    """Draft tokens per batch size (index = batch size; past the end: 0), as `dense_schedule` gives them."""
    dense = [draft_range[0][1]]  # batch size 0 (no request runs) never drafts anything anyway
    for last, k in draft_range:
        dense += [k] * (last + 1 - len(dense))
    return [*dense, 0]


def dense_schedule(vllm_config: Any) -> list[int] | None:
    """Draft tokens per batch size (index = batch size, up to max_num_seqs) from the engine's
    config, expanded as vLLM's scheduler expands it; None when no schedule is configured."""
    spec = vllm_config.speculative_config
    schedule = getattr(spec, SCHEDULE_FIELD, None)
    if not schedule:
        return None
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup: list[int] = build_dynamic_sd_schedule_lookup(
        schedule, vllm_max_batch_size=int(vllm_config.scheduler_config.max_num_seqs),
        vllm_num_speculative_tokens=int(spec.num_speculative_tokens))
    return lookup
