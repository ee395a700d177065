"""When to speculate in the static mode: the published batch-size threshold, or vLLM's batch-size schedule.

A gate decides, every step, whether the proposer drafts at all, and which requests it drafts for.  The
adaptive mode (the default) decides row by row from expected goodput instead
(`samrollout.spec_decode.goodput`), and its gate lets everything through.
"""

from __future__ import annotations

from collections.abc import Sequence

from samrollout.config import SpeculationConfig


class Gate:
    """Base gate: decides per step (batch size) and per request; this one allows everything ("off", and the
    adaptive mode, whose policy decides)."""

    def allow_step(self, running: int) -> bool:
        """Whether to draft at all in a step with ``running`` requests."""
        return True

    def draft_limit(self, running: int, k: int) -> int:
        """Most draft tokens per request in an allowed step with ``running`` requests."""
        return k


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


def make_gate(config: SpeculationConfig, schedule: Sequence[int] | None = None) -> Gate:
    """The gate a config asks for; ``schedule``: vLLM's expanded batch-size schedule, if configured."""
    if config.threshold_mode == "off":
        return Gate()
    if config.threshold_mode == "static":
        return StaticGate(config.threshold, schedule)
    return Gate()  # adaptive: the goodput policy decides row by row (samrollout.spec_decode.goodput)
