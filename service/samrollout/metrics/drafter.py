"""The proposer's view (read from the worker at each scrape): step-time histogram and speculation state.

The proposer runs inside vLLM's worker process, so its numbers cross over by
``collective_rpc("samrollout_drafter_stats")`` when /metrics is scraped;
`DrafterCollector` then exports the step-time histogram from the proposer's own bucket
counts (no per-step samples cross processes).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import REGISTRY, CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from samrollout.metrics import definitions as m
from samrollout.spec_decode.stats import STEP_SECONDS_BUCKETS, HistoryStats, ProposerStats


class DrafterCollector(Collector):
    """Exports ``samrollout_drafter_step_seconds`` and the per-source draft counters from the last snapshot
    of the proposer's stats."""

    def __init__(self) -> None:
        self.snapshot: ProposerStats | None = None

    def update(self, stats: ProposerStats | None) -> None:
        """Take a new snapshot (`SamProposer.stats`; None: speculation is off) and set the speculation gauges."""
        self.snapshot = stats
        if stats is None:
            m.SPECULATION_ACTIVE.set(0)
            return
        m.SPECULATION_ACTIVE.set(1 if stats.last_step_drafted else 0)
        m.SPECULATION_THRESHOLD.set(stats.threshold)
        m.SPECULATION_K.set(stats.k)
        m.DRAFTER_ACTIVE_REQUESTS.set(stats.active_requests)
        m.DRAFTER_HISTORY_TOKENS.set(stats.history.tokens if stats.history is not None else 0)
        m.DRAFTER_GLOBAL_TOKENS.set(stats.global_tokens)

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        """The histogram, cumulative over the proposer's bucket counts (nothing before the first snapshot),
        draft tokens proposed and accepted per source, and the history's counters (with the history on)."""
        stats = self.snapshot
        if stats is None:
            return
        drafted = CounterMetricFamily(f"{m.P}drafter_source_draft_tokens",
                                      "Draft tokens proposed to the engine, by source (own, group, global)",
                                      labels=["source"])
        accepted = CounterMetricFamily(f"{m.P}drafter_source_accepted_tokens",
                                       "Draft tokens the engine accepted, by the source that drafted them",
                                       labels=["source"])
        for source, counts in stats.sources.items():
            drafted.add_metric([source], counts.draft_tokens)
            accepted.add_metric([source], counts.accepted_tokens)
        yield drafted
        yield accepted
        if stats.history is not None:
            yield from _history_counters(stats.history)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, STEP_SECONDS_BUCKETS), "+Inf"], stats.step_seconds_counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(f"{m.P}drafter_step_seconds", "Proposer time per engine step (all rows)",
                                    buckets=buckets, sum_value=stats.propose_seconds)


def _history_counters(history: HistoryStats) -> Iterator[CounterMetricFamily]:
    """The cross-epoch history's counters: earlier responses joined, groups arrived, and groups that found their
    prompt's earlier responses there (hits / groups: how often a prompt came back to the server that saw it)."""
    yield CounterMetricFamily(f"{m.P}drafter_history_joined_responses",
                              "Earlier rollouts' responses that joined a later group's automaton",
                              value=history.joined_responses)
    yield CounterMetricFamily(f"{m.P}drafter_history_groups",
                              "Groups that arrived at the drafter with the cross-epoch history on (once per group)",
                              value=history.groups)
    yield CounterMetricFamily(f"{m.P}drafter_history_hit_groups",
                              "Groups whose prompt had earlier responses in this server's cross-epoch history "
                              "when they arrived", value=history.hit_groups)


DRAFTER_METRICS = DrafterCollector()
REGISTRY.register(DRAFTER_METRICS)
