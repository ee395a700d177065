"""A discrete-event model of one synchronous rollout: engine steps timed by a cost table, drafts by the real drafters.

Every response of a trace runs at its real length (its recorded tokens).  An instance has ``slots``
(vLLM's ``max_num_seqs``) and a KV budget in tokens; a step:

1. admits waiting sequences (in the scheduler's order) while a slot is free and the KV budget holds
   their prompt (a preempted sequence re-prefills its prompt and what it had generated);
2. verifies every decoding row's pending draft against its recorded continuation (a draft token is
   accepted while it equals the recorded token: for a sampled trace that is the right estimate, since
   a one-token draft x is accepted with probability p(x) and the recorded token is x with probability
   p(x)); each row advances by the accepted tokens plus one; a newly admitted row yields its first token;
3. takes ``CostTable.step_seconds(decoding rows, mean tokens per row, mean context)`` plus
   ``prefill_seconds`` for the prompt tokens admitted, plus (``charge_drafter``) the drafter's own
   time for the step, measured here as this thread's CPU time (so other load on the machine does
   not inflate it), as vLLM runs its proposer between steps;
4. hands every row's new tokens to the drafter, whose drafts are verified in the next step (vLLM's
   order: the proposer sees the step's sampled tokens, the next step verifies);
5. finishes rows that reached their length, and preempts the newest running sequence while the KV
   cache (every running sequence's prompt and output) exceeds the budget (vLLM's recompute preemption).

Ours drafts through the engine's own `DraftSession` (`samrollout.replay.drafters.SamReplayDrafter`,
given the simulated clock), the peers through the replay's `samrollout.replay.peers`.  The scheduling
policy is fcfs or length-aware through the server's own `AdmissionScheduler` and `LengthPredictor`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from samrollout.replay.protocol import ReplayDrafter, remember
from samrollout.replay.traces import TraceGroup
from samrollout.sim.admission import Admission
from samrollout.sim.cost import CostTable
from samrollout.sim.engine_step import EngineCounters, advance
from samrollout.sim.priors import fit_summary
from samrollout.sim.state import SimInstance, SimSequence, SimSettings
from samrollout_client.placement import GroupDemand, LeastOutstandingPlacement, least_loaded, place_groups
from samrollout_client.rollout_rules import MAX_MOVES, may_take_over

__all__ = ["SimResult", "SimSettings", "simulate"]

TIMELINE_POINTS = 400  # (time, running) samples kept per instance for the plot


@dataclass
class SimResult(EngineCounters):
    """What one mode's simulated rollout took."""

    mode: str = ""
    makespan_s: float = 0.0
    tail_s: float = 0.0
    tokens: int = 0
    moves: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, sequences unfinished)
    critical: dict[str, float] = field(default_factory=dict)  # the last response to finish: its path

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report (the timeline downsampled)."""
        return {"makespan_s": self.makespan_s, "tail_s": self.tail_s, "steps": self.steps,
                "tokens": self.tokens, "tokens_per_s": self.tokens / self.makespan_s if self.makespan_s else 0.0,
                "mean_acceptance_length": self.mean_acceptance_length,
                "drafted_acceptance_length": self.drafted_acceptance_length, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "preemptions": self.preemptions, "moves": self.moves, "drafter_s": self.drafter_s,
                "critical": self.critical, "step_cost_fit": fit_summary(self.step_cost_fit),
                "timeline": [[round(t, 4), n] for t, n in _downsample(self.timeline, TIMELINE_POINTS)]}


def _downsample(points: list[tuple[float, int]], most: int) -> list[tuple[float, int]]:
    if len(points) <= most:
        return points
    stride = len(points) / most
    return [points[int(i * stride)] for i in range(most)] + [points[-1]]


def simulate(groups: Sequence[TraceGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
             cost: CostTable, settings: SimSettings, mode: str = "",
             history: Sequence[Sequence[np.ndarray]] | None = None) -> SimResult:
    """Run one rollout of every response in ``groups`` through the model above; None drafter: no speculation."""
    return asyncio.run(_simulate(groups, drafter_factory, k, cost, settings, mode, history))


async def _simulate(groups: Sequence[TraceGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
                    cost: CostTable, settings: SimSettings, mode: str,
                    history: Sequence[Sequence[np.ndarray]] | None) -> SimResult:
    # Inside an event loop: the length-aware scheduler is the server's own, which hands out futures.
    result = SimResult(mode=mode)
    sequences = [SimSequence(0, g, group.prompt, response.tolist(), prompt_key=f"p{g}")
                 for g, group in enumerate(groups) for response in group.responses if len(response)]
    for index, seq in enumerate(sequences):
        seq.index = index
    instances = [SimInstance(drafter_factory() if drafter_factory else None, k) for _ in range(settings.instances)]
    for instance in instances:
        if instance.drafter is not None:
            for g, earlier in enumerate(history or []):
                remember(instance.drafter, g, groups[g].prompt, earlier)
    admission = Admission(settings)
    place_least_outstanding(admission, instances, sequences)
    unfinished = len(sequences)
    while unfinished:
        instance = min((i for i in instances if i.running or i.waiting or admission.has_work(i)),
                       key=lambda i: i.clock)
        unfinished -= len(advance(instance, settings, cost, admission, result))
        if settings.divide_after_tokens is not None and len(instances) > 1:
            result.moves += _divide(instance, instances, settings.divide_after_tokens, admission)
        result.timeline.append((instance.clock, unfinished))
    _summarize(result, sequences, settings.tail_rows)
    return result


def place_least_outstanding(admission: Admission, instances: Sequence[SimInstance],
                            sequences: Sequence[SimSequence]) -> None:
    """Each prompt group whole to its instance as the trainer client's ``least-outstanding`` placement puts a
    rollout's groups (`samrollout_client.placement.place_groups`: all start at once and none has finished,
    so an instance's outstanding requests are the responses placed on it so far), then every instance's
    admitted sequences into its engine queue."""
    by_group: dict[int, list[SimSequence]] = {}
    for seq in sequences:
        by_group.setdefault(seq.group, []).append(seq)
    demands = [GroupDemand(f"p{group}", float(len(members))) for group, members in by_group.items()]
    names = [f"instance-{i}" for i in range(len(instances))]
    targets = place_groups(LeastOutstandingPlacement(), demands, names, [0.0] * len(instances))
    for (group, members), target in zip(by_group.items(), targets, strict=True):
        admission.enqueue(instances[target], members, f"g{group}")
    for instance in instances:
        admission.release(instance)


def _summarize(result: SimResult, sequences: Sequence[SimSequence], tail_rows: int) -> None:
    """Makespan, tail and the critical (last) response's path, from the sequences' finish times."""
    result.tokens = sum(len(seq.truth) for seq in sequences)
    finish = sorted(seq.finish_s for seq in sequences)
    result.makespan_s = finish[-1] if finish else 0.0
    tail_start = finish[-tail_rows - 1] if len(finish) > tail_rows else 0.0
    result.tail_s = result.makespan_s - tail_start
    result.timeline.sort()
    if sequences:
        last = max(sequences, key=lambda seq: seq.finish_s)
        result.critical = {"length": len(last.truth), "started_s": last.started_s, "finish_s": last.finish_s,
                           "steps": last.row_steps, "tokens_per_step": len(last.truth) / max(1, last.row_steps)}


def _divide(source: SimInstance, instances: Sequence[SimInstance], after_tokens: int, admission: Admission) -> int:
    """The client's divided rollout (`samrollout_client.rollouts.divided.move_target`): a running sequence whose
    current piece has ``after_tokens`` tokens moves to the instance streaming the fewest where there is
    room; there it re-prefills its prompt and tokens so far.  Returns how many moved."""
    moved = 0
    for seq in list(source.running):
        if seq.generated - seq.piece_start < after_tokens or seq.moves >= MAX_MOVES:
            continue
        targets = [t for t in instances if t is not source and _has_room(source, t, admission)]
        if not targets:
            continue
        target = targets[least_loaded([len(t.running) for t in targets])]
        source.running.remove(seq)
        if source.drafter is not None:
            source.drafter.remove(seq.index)
        admission.finished(source, seq)  # the source's server sees the piece end (cut short)
        seq.draft, seq.in_drafter = [], False
        seq.piece_start, seq.moves, seq.ready_s = seq.generated, seq.moves + 1, source.clock
        target.waiting.append(seq)
        moved += 1
    return moved


def _has_room(source: SimInstance, target: SimInstance, admission: Admission) -> bool:
    """`samrollout_client.rollouts.divided.has_room`: nothing waits on the target, and it streams fewer."""
    return may_take_over(len(source.running), bool(source.waiting) or admission.has_work(source),
                         len(target.running), bool(target.waiting) or admission.has_work(target))
