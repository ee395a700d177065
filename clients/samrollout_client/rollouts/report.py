"""Combine per-endpoint rollout summaries (``GET /v1/rollouts/{id}``) into one `RolloutReport`."""

from __future__ import annotations

from collections import Counter
from typing import Any

from samrollout_client.types import RolloutReport


def combine_summaries(rollout_id: str, summaries: list[dict[str, Any]]) -> RolloutReport:
    """One report over the endpoints that served part of the rollout.

    Makespan runs from the earliest start to the latest end; the tail is the longest
    endpoint tail (endpoints work in parallel); lengths and tokens add up; the median is
    the weighted median of the endpoints' medians (exact with one endpoint).
    """
    start = min(s["started_at"] for s in summaries)
    end = max(s["started_at"] + s["makespan_s"] for s in summaries)
    makespan = end - start
    tail = min(makespan, max(s["tail_s"] for s in summaries))  # clock rounding must not make it exceed
    sequences = sum(s["sequences"] for s in summaries)
    output_tokens = sum(s["output_tokens"] for s in summaries)
    medians = sorted((s["median_tokens"], s["sequences"]) for s in summaries)
    half, seen, median = sequences / 2, 0, 0.0
    for value, weight in medians:
        seen += weight
        if seen >= half:
            median = value
            break
    accepted = sum(s["draft_tokens_accepted"] for s in summaries)
    lengths = [s["mean_acceptance_length"] for s in summaries if s.get("mean_acceptance_length")]
    reasons: Counter[str] = Counter()
    for s in summaries:
        reasons.update(s["finish_reasons"])
    return RolloutReport(rollout_id=rollout_id, endpoints=len(summaries), sequences=sequences,
                         output_tokens=output_tokens, makespan_s=makespan, tail_s=tail,
                         tail_share=tail / makespan if makespan > 0 else 0.0,
                         longest_tokens=max(s["longest_tokens"] for s in summaries), median_tokens=median,
                         mean_acceptance_length=sum(lengths) / len(lengths) if lengths else None,
                         draft_tokens_accepted=accepted, finish_reasons=dict(reasons))
