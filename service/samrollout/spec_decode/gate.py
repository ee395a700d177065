"""When to speculate: the batch-size threshold, static or adaptive.

Speculation pays only while the engine is memory-bound (few running requests: the
tail); in the big-batch phase verifying k extra positions per request costs real
compute.  A gate decides, every step, whether the proposer drafts at all, and which
requests it drafts for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from samrollout.config import SpeculationConfig


class Gate:
    """Base gate: decides per step (batch size) and per request."""

    def allow_step(self, running: int) -> bool:
        """Whether to draft at all in a step with ``running`` requests."""
        return True

    def allow_request(self, request_id: str) -> bool:
        """Whether to draft for this request (after the step is allowed)."""
        return True

    def observe_step(self, running: int, drafted: bool, seconds: float) -> None:
        """Wall time of the engine step that followed a decision (for adaptive gates)."""

    def observe_request(self, request_id: str, drafted: int, accepted: int) -> None:
        """Outcome of a request's previous draft: tokens proposed, tokens accepted."""

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop state of requests that left the engine."""


class StaticGate(Gate):
    """The published rule: draft while at most ``threshold`` requests run."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def allow_step(self, running: int) -> bool:
        """Draft in the tail only."""
        return running <= self.threshold


@dataclass
class _Ema:
    value: float = math.nan
    count: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.count == 0 else (1 - alpha) * self.value + alpha * x
        self.count += 1


@dataclass
class _RequestStats:
    drafted: int = 0
    accepted: int = 0
    muted_until_step: int = 0


@dataclass
class AdaptiveGate(Gate):
    """Decides from measurements whether drafting is worth its verification cost.

    Rule, per batch-size bucket b (powers of two: 1, 2, 3-4, 5-8, ...):
      drafting pays when  MAL / T_on(b) > 1 / T_off(b),  i.e.  MAL > T_on(b) / T_off(b),
    where T_on / T_off are exponential moving averages of the engine step time with and
    without drafts at that bucket, and MAL = 1 + accepted / steps-with-drafts over recent
    steps (tokens per step when drafting).  Until both times are known for a bucket the
    static threshold decides; afterwards the losing arm is still tried every
    ``explore_every`` steps so the estimate follows the workload.  Per request: one whose
    acceptance rate stays under ``min_request_acceptance`` after ``min_request_drafts``
    drafted tokens gets no drafts for ``mute_steps`` steps, then is tried again.
    """

    threshold: int = 8
    alpha: float = 0.2
    explore_every: int = 32
    min_request_acceptance: float = 0.1
    min_request_drafts: int = 24
    mute_steps: int = 64
    _on: dict[int, _Ema] = field(default_factory=dict)
    _off: dict[int, _Ema] = field(default_factory=dict)
    _mal: _Ema = field(default_factory=_Ema)
    _requests: dict[str, _RequestStats] = field(default_factory=dict)
    _step: int = 0

    @staticmethod
    def bucket(running: int) -> int:
        """Power-of-two bucket of a batch size."""
        return max(1, running - 1).bit_length()

    def speculation_pays(self, running: int) -> bool | None:
        """The rule above for this batch size, or None while it lacks measurements."""
        b = self.bucket(running)
        on, off = self._on.get(b), self._off.get(b)
        if on is None or off is None or self._mal.count == 0:
            return None
        return self._mal.value > on.value / off.value

    def allow_step(self, running: int) -> bool:
        """The measured rule, the static rule before it has data, and periodic exploration."""
        self._step += 1
        verdict = self.speculation_pays(running)
        prior = running <= self.threshold
        if verdict is None:
            b = self.bucket(running)
            # Measure the arm the static rule would not take, once in a while.
            missing_on = b not in self._on and not prior
            missing_off = b not in self._off and prior
            if (missing_on or missing_off) and self._step % self.explore_every == 0:
                return not prior
            return prior
        if self._step % self.explore_every == 0:
            return not verdict
        return verdict

    def allow_request(self, request_id: str) -> bool:
        """False while a request with persistently low acceptance is muted."""
        stats = self._requests.get(request_id)
        return stats is None or stats.muted_until_step <= self._step

    def observe_step(self, running: int, drafted: bool, seconds: float) -> None:
        """Fold a step's wall time into the bucket's on/off average."""
        table = self._on if drafted else self._off
        table.setdefault(self.bucket(running), _Ema()).add(seconds, self.alpha)

    def observe_request(self, request_id: str, drafted: int, accepted: int) -> None:
        """Track acceptance globally (MAL) and per request (muting)."""
        if drafted <= 0:
            return
        self._mal.add(1.0 + accepted, self.alpha / 4)
        stats = self._requests.setdefault(request_id, _RequestStats())
        stats.drafted += drafted
        stats.accepted += accepted
        if stats.drafted >= self.min_request_drafts:
            if stats.accepted / stats.drafted < self.min_request_acceptance:
                stats.muted_until_step = self._step + self.mute_steps
            stats.drafted = stats.accepted = 0  # judge the next window afresh

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request stats of finished requests."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)


def make_gate(config: SpeculationConfig) -> Gate:
    """The gate a config asks for."""
    if config.threshold_mode == "off":
        return Gate()
    if config.threshold_mode == "static":
        return StaticGate(config.threshold)
    return AdaptiveGate(threshold=config.threshold)
