"""Who enters a simulated engine next: fcfs or the server's length-aware order, per instance.

- fcfs: every sequence goes straight to its instance's engine queue, in the order placed (vLLM's own FCFS).
- length-aware: the server's `AdmissionScheduler` (probes first, then the longest predicted groups)
  lets at most slots + headroom sequences into the engine queue, re-deciding whenever one finishes,
  with the server's `LengthPredictor` fed the simulated progress.  It must run inside an event loop.

Each instance keeps its own scheduler and predictor for as long as the `Admission` lives, so across the
steps of an RL loop an instance predicts a prompt's lengths only from what ran on it.  Placement (which
instance a group goes to) is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence

from samrollout.server.engine.admission import (
    AdmissionEntry,
    AdmissionScheduler,
    admission_headroom,
)
from samrollout.server.engine.length_predictor import LengthPredictor
from samrollout.server.settings import SCHEDULING_POLICIES
from samrollout.sim.state import SimInstance, SimSequence, SimSettings


class Admission:
    """Admission order on every instance of one simulated run (see the module docstring)."""

    def __init__(self, settings: SimSettings) -> None:
        if settings.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_POLICIES)}, got {settings.scheduling!r}")
        self.length_aware = settings.scheduling == "length-aware"
        self.capacity = settings.slots + admission_headroom(settings.slots)
        self._schedulers: dict[int, AdmissionScheduler] = {}
        self._entries: dict[int, AdmissionEntry] = {}
        self._sequences: dict[int, SimSequence] = {}

    def enqueue(self, instance: SimInstance, members: Sequence[SimSequence], group_key: str) -> None:
        """A group's sequences arrive at ``instance`` (call `release` once a batch is placed)."""
        for seq in members:
            self._sequences[seq.index] = seq
        if not self.length_aware:
            instance.waiting.extend(members)
            return
        scheduler = self._schedulers.get(id(instance))
        if scheduler is None:
            scheduler = self._schedulers[id(instance)] = AdmissionScheduler(self.capacity, LengthPredictor(),
                                                                             self._progress)
        for seq in members:
            self._entries[seq.index] = scheduler.enqueue(str(seq.index), str(seq.index), group_key,
                                                         seq.prompt_key or group_key)

    def _progress(self, child: str) -> int:
        return self._sequences[int(child)].generated

    def has_work(self, instance: SimInstance) -> bool:
        """Whether sequences still wait in the server's queue for this instance."""
        scheduler = self._schedulers.get(id(instance))
        return scheduler is not None and bool(scheduler.waiting)

    def release(self, instance: SimInstance) -> None:
        """Move the sequences the server has admitted into the instance's engine queue."""
        scheduler = self._schedulers.get(id(instance))
        if scheduler is None:
            return
        queued = {seq.index for seq in instance.waiting} | {seq.index for seq in instance.running}
        for entry in scheduler.running.values():
            index = int(entry.child_id)
            seq = self._sequences[index]
            if index not in queued and seq.generated < len(seq.truth):
                instance.waiting.append(seq)

    def finished(self, instance: SimInstance, seq: SimSequence) -> None:
        """A sequence finished: the server learns its length and admits the next."""
        scheduler = self._schedulers.get(id(instance))
        entry = self._entries.pop(seq.index, None)  # a moved sequence's later pieces bypass the schedulers
        if scheduler is not None and entry is not None:
            scheduler.done(entry, seq.generated)

    def cancel(self, instance: SimInstance, seq: SimSequence) -> None:
        """A sequence left before it finished (aborted, restarted): the server forgets it without learning a length."""
        scheduler = self._schedulers.get(id(instance))
        entry = self._entries.pop(seq.index, None)
        if scheduler is not None and entry is not None:
            scheduler.withdraw(entry)
