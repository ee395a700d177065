"""Rollouts as the HTTP layer sees them: requests tagged with one ``rollout_id``.

For each rollout we keep its sequences in flight (prompts x n), start and end, output
lengths, and its tail: the time during which at most ``threshold`` of its sequences were
running (after it had been above the threshold; a rollout that never was is all tail).
A rollout ends when nothing of it has been in flight for ``idle_seconds``; then its
makespan, tail, tail share and longest/median ratio go into the Prometheus histograms.
Per-rollout detail is served from a bounded table of recent rollouts
(``GET /v1/rollouts/{id}``), never as metric labels; it includes how many of the rollout's
sequences each weight version produced (``weight_versions``, the labels their responses
carry).  A rollout id used again after it ended continues its summary and is counted again
when it next ends.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from samrollout.metrics import definitions as m


@dataclass
class SequenceOutcome:
    """One finished sequence (one choice): its length, accepted draft tokens if known, why it ended, and the
    weight version that produced it (the label its response carries; `samrollout.server.weights.weight_labels`)."""

    output_tokens: int
    accepted_draft_tokens: int | None
    finish_reason: str | None
    weight_version: str | None = None


def drafted_tokens_returned(outcome: SequenceOutcome) -> int:
    """The accepted draft tokens among those the sequence returned.

    vLLM counts every accepted draft token, also those past ``max_tokens`` or a stop string that the response
    cuts off (a 32-token draft accepted whole when 2 tokens were left), and a sequence's first token is never a
    draft: at most all but one of the tokens returned came from drafts.
    """
    return min(outcome.accepted_draft_tokens or 0, max(0, outcome.output_tokens - 1))


@dataclass
class RolloutState:
    """What we know of one rollout so far."""

    rollout_id: str
    started_wall: float
    started: float
    in_flight: int = 0
    peak_in_flight: int = 0
    requests: int = 0
    tail_started: float | None = None
    ended: float | None = None  # when the last in-flight sequence finished; None while any runs
    output_tokens: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    measured_tokens: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    weight_versions: Counter[str] = field(default_factory=Counter)  # sequences per weight version
    done: bool = False
    threshold: int = field(kw_only=True)  # the server's (`RolloutTracker`): where its tail starts

    def tail_seconds(self, now: float) -> float:
        """Time in the tail so far (all of it if the rollout never ran above the threshold)."""
        end = self.ended if self.ended is not None else now
        if self.peak_in_flight <= self.threshold:
            return end - self.started
        return end - self.tail_started if self.tail_started is not None else 0.0

    def to_dict(self, now: float) -> dict[str, Any]:
        """The summary served at /v1/rollouts/{id}."""
        end = self.ended if self.ended is not None else now
        makespan = end - self.started
        tail = min(makespan, self.tail_seconds(now))
        lengths = self.output_tokens
        median = statistics.median(lengths) if lengths else 0.0
        return {
            "rollout_id": self.rollout_id, "finished": self.done, "started_at": self.started_wall,
            "makespan_s": makespan, "tail_s": tail, "tail_share": tail / makespan if makespan > 0 else 0.0,
            "threshold": self.threshold, "requests": self.requests, "sequences": len(lengths),
            "in_flight": self.in_flight, "peak_in_flight": self.peak_in_flight,
            "output_tokens": sum(lengths), "longest_tokens": max(lengths, default=0), "median_tokens": median,
            "longest_to_median": (max(lengths) / median) if lengths and median > 0 else None,
            "draft_tokens_accepted": self.draft_tokens,
            "mean_acceptance_length": self._acceptance_length(),
            "finish_reasons": dict(self.finish_reasons),
            "weight_versions": dict(self.weight_versions),
        }

    def _acceptance_length(self) -> float | None:
        """Output tokens per model step over the sequences with per-request speculation metrics."""
        steps = self.measured_tokens - self.draft_tokens
        return self.measured_tokens / steps if self.measured_tokens and steps > 0 else None


class RolloutTracker:
    """In-flight accounting per rollout id; bounded memory (``keep`` most recent rollouts)."""

    def __init__(self, threshold: int, idle_seconds: float = 2.0, keep: int = 512) -> None:
        self.threshold, self.idle_seconds, self.keep = threshold, idle_seconds, keep
        self._rollouts: OrderedDict[str, RolloutState] = OrderedDict()

    def begin(self, rollout_id: str, sequences: int) -> None:
        """``sequences`` of ``rollout_id`` start (one HTTP request: prompts x n)."""
        now = time.monotonic()
        state = self._rollouts.get(rollout_id)
        if state is None:
            state = RolloutState(rollout_id, time.time(), now, threshold=self.threshold)
            self._rollouts[rollout_id] = state
            while len(self._rollouts) > self.keep:
                self._rollouts.popitem(last=False)
        self._rollouts.move_to_end(rollout_id)
        state.done, state.ended = False, None
        state.requests += 1
        self._move(state, sequences, now)
        m.ROLLOUTS_ACTIVE.set(self.active())

    def end(self, rollout_id: str, sequences: int, outcomes: list[SequenceOutcome]) -> None:
        """The request that began ``sequences`` is over; ``outcomes`` are its finished choices."""
        state = self._rollouts.get(rollout_id)
        if state is None:
            return
        now = time.monotonic()
        for outcome in outcomes:
            state.output_tokens.append(outcome.output_tokens)
            state.finish_reasons[outcome.finish_reason or "unknown"] += 1
            if outcome.weight_version is not None:
                state.weight_versions[outcome.weight_version] += 1
            if outcome.accepted_draft_tokens is None:
                m.ROLLOUT_TOKENS.labels(source="unmeasured").inc(outcome.output_tokens)
            else:
                from_drafts = drafted_tokens_returned(outcome)
                state.draft_tokens += from_drafts
                state.measured_tokens += outcome.output_tokens
                m.ROLLOUT_TOKENS.labels(source="draft").inc(from_drafts)
                m.ROLLOUT_TOKENS.labels(source="model").inc(outcome.output_tokens - from_drafts)
        self._move(state, -sequences, now)
        if state.in_flight == 0:
            state.ended = now
        m.ROLLOUTS_ACTIVE.set(self.active())

    def _move(self, state: RolloutState, delta: int, now: float) -> None:
        before = state.in_flight
        state.in_flight = max(0, before + delta)
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        if state.in_flight > self.threshold:
            state.tail_started = None
        elif before > self.threshold:  # it just dropped to the threshold: the tail starts
            state.tail_started = now

    def finish_idle(self) -> int:
        """End the rollouts idle for ``idle_seconds``: observe their histograms; returns how many ended."""
        now = time.monotonic()
        ended = 0
        for state in self._rollouts.values():
            if state.done or state.ended is None or now - state.ended < self.idle_seconds:
                continue
            summary = state.to_dict(now)
            m.ROLLOUT_MAKESPAN.observe(summary["makespan_s"])
            m.ROLLOUT_TAIL.observe(summary["tail_s"])
            m.ROLLOUT_TAIL_SHARE.observe(summary["tail_share"])
            if summary["longest_to_median"] is not None:
                m.ROLLOUT_LONGEST_TO_MEDIAN.observe(summary["longest_to_median"])
            state.done = True
            ended += 1
        m.ROLLOUTS_ACTIVE.set(self.active())
        return ended

    def active(self) -> int:
        """Rollouts with sequences in flight."""
        return sum(1 for state in self._rollouts.values() if state.in_flight > 0)

    def summary(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout's summary, or None if it is unknown (or old enough to have been dropped)."""
        state = self._rollouts.get(rollout_id)
        return state.to_dict(time.monotonic()) if state is not None else None

    def recent(self) -> list[str]:
        """Rollout ids in the table, oldest first."""
        return list(self._rollouts)
