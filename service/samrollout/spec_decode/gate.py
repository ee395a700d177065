"""When to speculate: the batch-size threshold, static or adaptive.

Speculation pays only while the engine is memory-bound (few running requests: the
tail); in the big-batch phase verifying k extra positions per request costs real
compute.  A gate decides, every step, whether the proposer drafts at all, and which
requests it drafts for.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from samrollout.config import SpeculationConfig
from samrollout.spec_decode.stats import GateBucket


class Gate:
    """Base gate: decides per step (batch size) and per request."""

    def allow_step(self, running: int) -> bool:
        """Whether to draft at all in a step with ``running`` requests."""
        return True

    def allow_request(self, request_id: Hashable) -> bool:
        """Whether to draft for this request (after the step is allowed)."""
        return True

    def draft_limit(self, running: int, k: int) -> int:
        """Most draft tokens per request in an allowed step with ``running`` requests."""
        return k

    def observe_step(self, running: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One finished engine step: its batch size, whether any request in it verified a draft,
        its wall time, and the tokens it produced (accepted drafts plus one per request)."""

    def observe_request(self, request_id: Hashable, drafted: int, accepted: int) -> None:
        """Outcome of a request's previous draft: tokens proposed, tokens accepted."""

    def forget(self, request_ids: Iterable[Hashable]) -> None:
        """Drop state of requests that left the engine."""

    def summary(self) -> dict[str, GateBucket]:
        """What the gate has measured, per batch-size bucket (nothing for gates that measure nothing)."""
        return {}


class StaticGate(Gate):
    """The published rule: draft while at most ``threshold`` requests run.

    With ``schedule`` (vLLM's batch-size schedule, expanded: draft tokens per batch size,
    see `samrollout.spec_decode.schedule`) the schedule decides instead, and also caps the
    draft length; batch sizes past its end take its last entry.
    """

    def __init__(self, threshold: int, schedule: Sequence[int] | None = None) -> None:
        self.threshold = threshold
        self.schedule = list(schedule) if schedule else None

    def allow_step(self, running: int) -> bool:
        """Draft in the tail only."""
        if self.schedule is None:
            return running <= self.threshold
        return self.draft_limit(running, 1) > 0

    def draft_limit(self, running: int, k: int) -> int:
        """The schedule's draft length at this batch size (k without a schedule)."""
        if self.schedule is None:
            return k
        return min(k, self.schedule[min(running, len(self.schedule) - 1)])


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
    """Drafts where it measurably produces more tokens per second than not drafting.

    Rule, per batch-size bucket b (1-2, 3-4, 5-8, ... running requests):
      draft  iff  R_on(b) > R_off(b),
    where R_on / R_off are moving averages (weight ``alpha``) of the engine's output rate,
    tokens produced / step wall time, over steps at that bucket that did / did not verify
    drafts.  This is the break-even rule ``mean tokens per request-step > T_on / T_off``
    measured end to end: it counts requests that had no draft or were muted, the bonus
    token, and the verification cost on this hardware at this batch size, so it needs no
    cost model.  Steps that also prefilled a new request are left out (their time is not
    decode time).  Each arm needs ``min_samples`` steps before it counts; until then the
    static threshold decides and the other arm is tried every ``explore_every`` steps;
    once both are measured, the losing arm is still tried every ``explore_decided`` steps,
    so the estimate keeps following the workload at a small cost.  Per request: one whose
    acceptance rate stays under ``min_request_acceptance`` after ``min_request_drafts``
    drafted tokens gets no drafts for ``mute_steps`` steps, then is tried again.
    """

    threshold: int = SpeculationConfig.threshold
    alpha: float = 0.1
    min_samples: int = 3
    explore_every: int = 16
    explore_decided: int = 64
    min_request_acceptance: float = 0.1
    min_request_drafts: int = 24
    mute_steps: int = 64
    _on: dict[int, _Ema] = field(default_factory=dict)
    _off: dict[int, _Ema] = field(default_factory=dict)
    _requests: dict[Hashable, _RequestStats] = field(default_factory=dict)
    _step: int = 0

    @staticmethod
    def bucket(running: int) -> int:
        """Power-of-two bucket of a batch size: 1 for 1-2 running, 2 for 3-4, 3 for 5-8, ..."""
        return max(1, running - 1).bit_length()

    def rates(self, running: int) -> tuple[float, float]:
        """(R_on, R_off) in tokens/s at this batch size's bucket; NaN where not measured yet."""
        b = self.bucket(running)
        on, off = self._on.get(b, _Ema()), self._off.get(b, _Ema())
        return ((on.value if on.count >= self.min_samples else math.nan),
                (off.value if off.count >= self.min_samples else math.nan))

    def speculation_pays(self, running: int) -> bool | None:
        """The rule above for this batch size, or None while it lacks measurements."""
        on, off = self.rates(running)
        if math.isnan(on) or math.isnan(off):
            return None
        return on > off

    def summary(self) -> dict[str, GateBucket]:
        """Per bucket, named by its largest batch size ("<=8"): measured on/off rates and step counts."""
        table: dict[str, GateBucket] = {}
        for b in sorted(set(self._on) | set(self._off)):
            on, off = self._on.get(b, _Ema()), self._off.get(b, _Ema())
            table[f"<={1 << b}"] = GateBucket(on.value, off.value, on.count, off.count)
        return table

    def allow_step(self, running: int) -> bool:
        """The measured rule (the static rule before it has data), and periodic exploration."""
        self._step += 1
        verdict = self.speculation_pays(running)
        choice = running <= self.threshold if verdict is None else verdict
        explore = self.explore_every if verdict is None else self.explore_decided
        if self._step % explore == 0:
            return not choice
        return choice

    def allow_request(self, request_id: Hashable) -> bool:
        """False while a request with persistently low acceptance is muted."""
        stats = self._requests.get(request_id)
        return stats is None or stats.muted_until_step <= self._step

    def observe_step(self, running: int, drafted: bool, seconds: float, tokens: int) -> None:
        """Fold a decode step's output rate into its bucket's on or off average."""
        if seconds <= 0 or running <= 0:
            return
        table = self._on if drafted else self._off
        table.setdefault(self.bucket(running), _Ema()).add(tokens / seconds, self.alpha)

    def observe_request(self, request_id: Hashable, drafted: int, accepted: int) -> None:
        """Per-request acceptance, for muting requests whose drafts keep failing."""
        if drafted <= 0:
            return
        stats = self._requests.setdefault(request_id, _RequestStats())
        stats.drafted += drafted
        stats.accepted += accepted
        if stats.drafted >= self.min_request_drafts:
            if stats.accepted / stats.drafted < self.min_request_acceptance:
                stats.muted_until_step = self._step + self.mute_steps
            stats.drafted = stats.accepted = 0  # judge the next window afresh

    def forget(self, request_ids: Iterable[Hashable]) -> None:
        """Drop per-request stats of finished requests."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)


def make_gate(config: SpeculationConfig, schedule: Sequence[int] | None = None) -> Gate:
    """The gate a config asks for; ``schedule``: vLLM's expanded batch-size schedule, if configured."""
    if config.threshold_mode == "off":
        return Gate()
    if config.threshold_mode == "static":
        return StaticGate(config.threshold, schedule)
    return AdaptiveGate(threshold=config.threshold)
