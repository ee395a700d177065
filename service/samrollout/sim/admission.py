"""Who enters a simulated engine next: placement across instances, then fcfs or the server's length-aware order.

- Placement (``instances`` > 1): each prompt group goes whole to the instance with the fewest
  sequences placed so far (least outstanding, as the trainer client balances servers).
- fcfs: every sequence goes straight to its instance's engine queue, in trace order (vLLM's own FCFS).
- length-aware: the server's `AdmissionScheduler` (probes first, then the longest predicted groups)
  lets at most slots + headroom sequences into the engine queue, re-deciding whenever one finishes,
  with the server's `LengthPredictor` fed the simulated progress.  It must run inside an event loop.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from samrollout.server.admission import AdmissionEntry, AdmissionScheduler, admission_headroom
from samrollout.server.length_predictor import LengthPredictor

if TYPE_CHECKING:
    from samrollout.sim.rollout import SimSettings, _Instance, _Sequence


class Admission:
    """Placement and admission order for one simulated rollout (see the module docstring)."""

    def __init__(self, settings: SimSettings, instances: Sequence[_Instance], sequences: Sequence[_Sequence]) -> None:
        if settings.scheduling not in ("fcfs", "length-aware"):
            raise ValueError(f"scheduling must be fcfs or length-aware, got {settings.scheduling!r}")
        self.length_aware = settings.scheduling == "length-aware"
        by_group: dict[int, list[Any]] = defaultdict(list)
        for seq in sequences:
            by_group[seq.group].append(seq)
        placed = [0] * len(instances)
        self._schedulers: dict[int, AdmissionScheduler] = {}
        self._entries: dict[int, AdmissionEntry] = {}
        self._sequences = {seq.index: seq for seq in sequences}
        for group, members in by_group.items():
            target = min(range(len(instances)), key=lambda i: placed[i])
            placed[target] += len(members)
            instance = instances[target]
            if not self.length_aware:
                instance.waiting.extend(members)
                continue
            scheduler = self._schedulers.get(id(instance))
            if scheduler is None:
                scheduler = self._schedulers[id(instance)] = AdmissionScheduler(
                    settings.slots + admission_headroom(settings.slots), LengthPredictor(), self._progress)
            for seq in members:
                self._entries[seq.index] = scheduler.enqueue(str(seq.index), str(seq.index), f"g{group}",
                                                             f"p{group}")
        for instance in instances:
            self.release(instance)

    def _progress(self, child: str) -> int:
        return self._sequences[int(child)].generated

    def has_work(self, instance: _Instance) -> bool:
        """Whether sequences still wait in the server's queue for this instance."""
        scheduler = self._schedulers.get(id(instance))
        return scheduler is not None and bool(scheduler.waiting)

    def release(self, instance: _Instance) -> None:
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

    def finished(self, instance: _Instance, seq: _Sequence) -> None:
        """A sequence finished: the server learns its length and admits the next."""
        scheduler = self._schedulers.get(id(instance))
        entry = self._entries.pop(seq.index, None)  # a moved sequence's later pieces bypass the schedulers
        if scheduler is not None and entry is not None:
            scheduler.done(entry, seq.generated)
