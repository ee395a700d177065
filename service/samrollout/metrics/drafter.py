"""The proposer's view (read from the worker at each scrape): step-time histogram and speculation state.

The proposer runs inside vLLM's worker process, so its numbers cross over by
``collective_rpc("samrollout_drafter_stats")`` when /metrics is scraped;
`DrafterCollector` then exports the step-time histogram from the proposer's own bucket
counts (no per-step samples cross processes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import REGISTRY, CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from samrollout.metrics import definitions as m
from samrollout.spec_decode.proposer import STEP_SECONDS_BUCKETS


class DrafterCollector(Collector):
    """Exports ``samrollout_drafter_step_seconds`` and the per-source draft counters from the last snapshot
    of the proposer's stats."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> None:
        """Take a new snapshot (`SamProposer.stats`) and set the speculation gauges from it."""
        self.snapshot = stats
        if not stats:
            m.SPECULATION_ACTIVE.set(0)
            return
        m.SPECULATION_ACTIVE.set(1 if stats.get("last_step_drafted") else 0)
        m.SPECULATION_THRESHOLD.set(stats.get("threshold", 0))
        m.SPECULATION_K.set(stats.get("k", 0))
        m.DRAFTER_ACTIVE_REQUESTS.set(stats.get("active_requests", 0))
        m.DRAFTER_HISTORY_TOKENS.set((stats.get("history") or {}).get("tokens", 0))
        m.DRAFTER_GLOBAL_TOKENS.set(stats.get("global_tokens", 0))

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        """The histogram, cumulative over the proposer's bucket counts (nothing before the first snapshot),
        draft tokens proposed and accepted per source, and the count of earlier responses that joined
        group automata (with the history on)."""
        sources = self.snapshot.get("sources")
        if sources:
            drafted = CounterMetricFamily(f"{m.P}drafter_source_draft_tokens",
                                          "Draft tokens proposed to the engine, by source (own, group, global)",
                                          labels=["source"])
            accepted = CounterMetricFamily(f"{m.P}drafter_source_accepted_tokens",
                                           "Draft tokens the engine accepted, by the source that drafted them",
                                           labels=["source"])
            for source, counts in sources.items():
                drafted.add_metric([source], counts.get("draft_tokens", 0))
                accepted.add_metric([source], counts.get("accepted_tokens", 0))
            yield drafted
            yield accepted
        history = self.snapshot.get("history")
        if history:
            yield CounterMetricFamily(f"{m.P}drafter_history_joined_responses",
                                      "Earlier rollouts' responses that joined a later group's automaton",
                                      value=history.get("joined_responses", 0))
        counts = self.snapshot.get("step_seconds_counts")
        if not counts:
            return
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, STEP_SECONDS_BUCKETS), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(f"{m.P}drafter_step_seconds", "Proposer time per engine step (all rows)",
                                    buckets=buckets, sum_value=float(self.snapshot.get("propose_seconds", 0.0)))


DRAFTER_METRICS = DrafterCollector()
REGISTRY.register(DRAFTER_METRICS)
