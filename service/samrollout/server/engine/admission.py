"""Length-aware admission (``--rollout-scheduling length-aware``): which waiting sequence enters the engine next.

The server holds sequences back and lets at most ``capacity`` into the engine: its
``max_num_seqs`` slots plus a small headroom (`admission_headroom`), so that a slot freed
inside the engine is refilled in its next step from the engine's short queue instead of
waiting a round trip through the server.  The choice of who enters is ours, re-made with
fresh predictions every time a sequence leaves:

1. **Probes first.** A sequence whose group has not started yet (and whose prompt has no
   history) goes before everything else, oldest first: its progress is what tells the group's
   length.
2. **Then the longest groups first**, by `LengthPredictor` (finished siblings, running
   siblings' tokens so far, earlier rollouts of the same prompt); ties and unknowns oldest first.

A running sequence is never preempted for a waiting one: preemption throws its KV cache
away and recomputes it, and admission order alone is what moves the long groups forward.
vLLM's own ``priority`` policy cannot do this: a request's priority is fixed when it is
added, before its group's probe has run.  Scheduling never changes tokens: each sequence
runs with its own sampling parameters and seed, whenever it is admitted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from samrollout.metrics import definitions as m
from samrollout.server.engine.length_predictor import LengthPredictor


def admission_headroom(slots: int) -> int:
    """Sequences let into the engine beyond its ``slots``: one per 8 slots, at least one."""
    return max(1, slots // 8)


@dataclass(eq=False)
class AdmissionEntry:
    """One sequence (an engine request with n = 1) waiting for, or holding, an engine slot."""

    child_id: str
    parent_id: str
    group: str
    order: int
    enqueued: float
    admitted: asyncio.Future[bool] = field(repr=False)
    predicted: float | None = None   # the group's predicted length when it was admitted
    was_probe: bool = False


class AdmissionScheduler:
    """Waiting sequences, engine slots, and the length-aware choice between them (one event loop)."""

    def __init__(self, capacity: int, predictor: LengthPredictor, progress: Callable[[str], int]) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity, self.predictor, self.progress = capacity, predictor, progress
        self.waiting: list[AdmissionEntry] = []
        self.running: dict[str, AdmissionEntry] = {}
        self._order = itertools.count()

    def enqueue(self, child_id: str, parent_id: str, group: str, prompt: str) -> AdmissionEntry:
        """Queue a sequence; it is admitted at once if a slot is free."""
        self.predictor.group(group, prompt)
        entry = AdmissionEntry(child_id, parent_id, group, next(self._order), time.monotonic(),
                               asyncio.get_running_loop().create_future())
        self.waiting.append(entry)
        self._admit()
        return entry

    def withdraw(self, entry: AdmissionEntry) -> None:
        """A sequence whose request went away before it ran (client disconnect): forget it, free its slot."""
        if entry in self.waiting:
            self.waiting.remove(entry)
            self._forget_if_idle(entry.group)
            m.SCHEDULER_WAITING.set(len(self.waiting))
            m.REQUESTS_FINISHED.labels(finish_reason="abort").inc()  # it never reached the engine's counts
        elif entry.child_id in self.running:
            self.done(entry, None)

    def done(self, entry: AdmissionEntry, output_tokens: int | None) -> None:
        """A running sequence left the engine; its slot goes to the next.

        ``output_tokens``: its length (for a sequence cut short, the tokens it got: a lower
        bound), or None when it produced nothing to learn from.
        """
        if self.running.pop(entry.child_id, None) is None:
            return
        self.predictor.finished(entry.group, entry.child_id, output_tokens)
        if output_tokens is not None and entry.predicted is not None and not entry.was_probe:
            m.SCHEDULER_PREDICTION_ERROR.observe((entry.predicted - output_tokens) / max(1, output_tokens))
        self._forget_if_idle(entry.group)
        self._admit()

    def abort_waiting(self, parent_ids: Iterable[str] | None = None) -> int:
        """End waiting sequences of ``parent_ids`` (all when None) unadmitted; returns how many."""
        wanted = None if parent_ids is None else set(parent_ids)
        ended = [e for e in self.waiting if wanted is None or e.parent_id in wanted]
        for entry in ended:
            self.waiting.remove(entry)
            if not entry.admitted.done():
                entry.admitted.set_result(False)
            self._forget_if_idle(entry.group)
        m.SCHEDULER_WAITING.set(len(self.waiting))
        if ended:  # they never reached the engine, whose finished requests are counted from its statistics
            m.REQUESTS_FINISHED.labels(finish_reason="abort").inc(len(ended))
        return len(ended)

    def status(self) -> dict[str, int]:
        """Counts for /admin/status."""
        return {"capacity": self.capacity, "running": len(self.running), "waiting": len(self.waiting),
                "groups": len(self.predictor.groups), "history_prompts": self.predictor.history_size()}

    def _admit(self) -> None:
        predictions: dict[str, float | None] = {}
        while self.waiting and len(self.running) < self.capacity:
            entry = min(self.waiting, key=lambda e: self._rank(e, predictions))
            self.waiting.remove(entry)
            record = self.predictor.groups[entry.group]
            entry.was_probe = record.started == 0
            entry.predicted = self._predicted(entry.group, predictions)
            self.predictor.started(entry.group, entry.child_id)
            predictions.pop(entry.group, None)  # its running set changed
            self.running[entry.child_id] = entry
            m.SCHEDULER_WAIT.observe(time.monotonic() - entry.enqueued)
            if not entry.admitted.done():
                entry.admitted.set_result(True)
        m.SCHEDULER_WAITING.set(len(self.waiting))

    def _rank(self, entry: AdmissionEntry, predictions: dict[str, float | None]) -> tuple[int, float, int]:
        record = self.predictor.groups[entry.group]
        if record.started == 0 and self.predictor.history(record.prompt) is None:
            return (0, 0.0, entry.order)  # a probe
        predicted = self._predicted(entry.group, predictions)
        return (1, -(predicted or 0.0), entry.order)

    def _predicted(self, group: str, predictions: dict[str, float | None]) -> float | None:
        if group not in predictions:
            predictions[group] = self.predictor.predict(group, self.progress)
        return predictions[group]

    def _forget_if_idle(self, group: str) -> None:
        self.predictor.forget_if_idle(group, sum(1 for e in self.waiting if e.group == group))
