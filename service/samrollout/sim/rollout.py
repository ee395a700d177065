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
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from samrollout.replay.protocol import ReplayDrafter, remember
from samrollout.replay.simulate import accepted_length
from samrollout.replay.traces import TraceGroup
from samrollout.sim.cost import CostTable

TIMELINE_POINTS = 400  # (time, running) samples kept per instance for the plot


@dataclass
class _Sequence:
    """One response being generated."""

    index: int
    group: int
    prompt: np.ndarray
    truth: list[int]
    generated: int = 0              # tokens produced so far
    draft: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    admitted_at: int = -1           # admission order on its instance (newest preempted first)
    in_drafter: bool = False        # started in the drafter since its last (re)admission
    finish_s: float = 0.0
    started_s: float = -1.0         # when it was first admitted
    row_steps: int = 0              # steps it decoded in
    piece_start: int = 0            # tokens it had when its current piece began (divided rollout)
    moves: int = 0                  # times it moved to another instance
    ready_s: float = 0.0            # not admitted before this (a moved sequence, from when it left)
    full: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # prompt + response

    def __post_init__(self) -> None:
        self.full = np.concatenate([self.prompt, np.asarray(self.truth, dtype=np.int32)]).astype(np.int32)

    @property
    def context(self) -> int:
        """Tokens in the KV cache: prompt and output so far."""
        return len(self.prompt) + self.generated


@dataclass
class SimResult:
    """What one mode's simulated rollout took."""

    mode: str
    makespan_s: float = 0.0
    tail_s: float = 0.0
    steps: int = 0
    decode_row_steps: int = 0
    drafting_row_steps: int = 0     # row-steps that verified a draft (vLLM's spec_decode_num_drafts)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0
    moves: int = 0
    drafter_s: float = 0.0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, sequences unfinished)
    critical: dict[str, float] = field(default_factory=dict)  # the last response to finish: its path

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per decoding row-step (accepted drafts plus the bonus token)."""
        return (self.decode_row_steps + self.accepted) / self.decode_row_steps if self.decode_row_steps else 0.0

    @property
    def drafted_acceptance_length(self) -> float:
        """Tokens per row-step that verified a draft (vLLM's mean acceptance length metric)."""
        return 1 + self.accepted / self.drafting_row_steps if self.drafting_row_steps else 1.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report (the timeline downsampled)."""
        return {"makespan_s": self.makespan_s, "tail_s": self.tail_s, "steps": self.steps,
                "tokens": self.tokens, "tokens_per_s": self.tokens / self.makespan_s if self.makespan_s else 0.0,
                "mean_acceptance_length": self.mean_acceptance_length,
                "drafted_acceptance_length": self.drafted_acceptance_length, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "preemptions": self.preemptions, "moves": self.moves, "drafter_s": self.drafter_s,
                "critical": self.critical,
                "timeline": [[round(t, 4), n] for t, n in _downsample(self.timeline, TIMELINE_POINTS)]}


def _downsample(points: list[tuple[float, int]], most: int) -> list[tuple[float, int]]:
    if len(points) <= most:
        return points
    stride = len(points) / most
    return [points[int(i * stride)] for i in range(most)] + [points[-1]]


@dataclass(frozen=True)
class SimSettings:
    """The rollout's shape: slots and KV budget per instance, instances, scheduling, drafter-time charge."""

    slots: int = 64
    kv_tokens: int | None = None
    instances: int = 1
    scheduling: str = "fcfs"
    charge_drafter: bool = True
    tail_rows: int = 8
    divide_after_tokens: int | None = None  # the client's divided rollout across instances (None: off)


class _Instance:
    """One engine: its slots, KV budget, running rows, clock and drafter."""

    def __init__(self, drafter: ReplayDrafter | None, k: int) -> None:
        self.drafter = drafter
        self.k = k
        self.clock = 0.0
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.admissions = 0
        if drafter is not None and hasattr(drafter, "clock"):
            drafter.clock = lambda: self.clock


def simulate(groups: Sequence[TraceGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
             cost: CostTable, settings: SimSettings, mode: str = "",
             history: Sequence[Sequence[np.ndarray]] | None = None) -> SimResult:
    """Run one rollout of every response in ``groups`` through the model above; None drafter: no speculation."""
    return asyncio.run(_simulate(groups, drafter_factory, k, cost, settings, mode, history))


async def _simulate(groups: Sequence[TraceGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
                    cost: CostTable, settings: SimSettings, mode: str,
                    history: Sequence[Sequence[np.ndarray]] | None) -> SimResult:
    # Inside an event loop: the length-aware scheduler is the server's own, which hands out futures.
    from samrollout.sim.admission import Admission

    result = SimResult(mode)
    sequences = [_Sequence(0, g, group.prompt, response.tolist())
                 for g, group in enumerate(groups) for response in group.responses if len(response)]
    for index, seq in enumerate(sequences):
        seq.index = index
    instances = [_Instance(drafter_factory() if drafter_factory else None, k) for _ in range(settings.instances)]
    for instance in instances:
        if instance.drafter is not None:
            for g, earlier in enumerate(history or []):
                remember(instance.drafter, g, groups[g].prompt, earlier)
    admission = Admission(settings, instances, sequences)
    unfinished = len(sequences)
    budget = settings.kv_tokens
    while unfinished:
        instance = min((i for i in instances if i.running or i.waiting or admission.has_work(i)),
                       key=lambda i: i.clock)
        admission.release(instance)
        if not instance.running and instance.waiting and instance.waiting[0].ready_s > instance.clock:
            instance.clock = instance.waiting[0].ready_s  # idle until a moved sequence arrives
        prefill_tokens = 0
        admitted: list[_Sequence] = []
        used = sum(seq.context for seq in instance.running)
        while instance.waiting and len(instance.running) + len(admitted) < settings.slots:
            seq = instance.waiting[0]
            if seq.ready_s > instance.clock:
                break
            if budget is not None and used + seq.context + 1 > budget and (instance.running or admitted):
                break
            instance.waiting.popleft()
            prefill_tokens += seq.context
            used += seq.context
            seq.admitted_at = instance.admissions
            if seq.started_s < 0:
                seq.started_s = instance.clock
            instance.admissions += 1
            admitted.append(seq)
        decoding = list(instance.running)
        step_tokens = 0
        for seq in decoding:
            accepted = accepted_length(seq.draft, seq.truth, seq.generated, len(seq.draft))
            advance = min(accepted + 1, len(seq.truth) - seq.generated)
            result.drafted += len(seq.draft)
            result.drafting_row_steps += bool(seq.draft)
            result.accepted += min(accepted, advance)
            result.decode_row_steps += 1
            seq.row_steps += 1
            step_tokens += 1 + len(seq.draft)
            seq.new_tokens = seq.truth[seq.generated: seq.generated + advance]
            seq.generated += advance
        for seq in admitted:  # the prefill samples one token; a resumed sequence shows all it has
            seq.generated += 1
            seq.new_tokens = seq.truth[:seq.generated]
        instance.running = decoding + admitted
        if decoding:
            context = sum(seq.context for seq in decoding) / len(decoding)
            seconds = cost.step_seconds(len(decoding), step_tokens / len(decoding), context)
        else:
            seconds = cost.step_seconds(1, 1, float(prefill_tokens))
        seconds += cost.prefill_seconds(prefill_tokens, float(prefill_tokens)) if prefill_tokens else 0.0
        drafter_seconds = _draft(instance)
        result.drafter_s += drafter_seconds
        instance.clock += seconds + (drafter_seconds if settings.charge_drafter else 0.0)
        result.steps += 1
        for seq in [s for s in instance.running if s.generated >= len(s.truth)]:
            instance.running.remove(seq)
            seq.finish_s = instance.clock
            unfinished -= 1
            if instance.drafter is not None:
                instance.drafter.remove(seq.index)
            admission.finished(instance, seq)
        while budget is not None and len(instance.running) > 1 and \
                sum(seq.context for seq in instance.running) > budget:
            victim = max(instance.running, key=lambda s: s.admitted_at)
            instance.running.remove(victim)
            victim.draft = []
            victim.in_drafter = False
            if instance.drafter is not None:
                instance.drafter.remove(victim.index)
            instance.waiting.appendleft(victim)
            result.preemptions += 1
        if settings.divide_after_tokens is not None and len(instances) > 1:
            result.moves += _divide(instance, instances, settings.divide_after_tokens, admission)
        result.timeline.append((instance.clock, unfinished))
    result.tokens = sum(len(seq.truth) for seq in sequences)
    finish = sorted(seq.finish_s for seq in sequences)
    result.makespan_s = finish[-1] if finish else 0.0
    tail_start = finish[-settings.tail_rows - 1] if len(finish) > settings.tail_rows else 0.0
    result.tail_s = result.makespan_s - tail_start
    result.timeline.sort()
    if sequences:
        last = max(sequences, key=lambda seq: seq.finish_s)
        result.critical = {"length": len(last.truth), "started_s": last.started_s, "finish_s": last.finish_s,
                           "steps": last.row_steps, "tokens_per_step": len(last.truth) / max(1, last.row_steps)}
    return result


MAX_MOVES = 4  # as the client's samrollout_client.divided.MAX_MOVES
MOVE_MARGIN = 2  # and its MOVE_MARGIN


def _divide(source: _Instance, instances: Sequence[_Instance], after_tokens: int, admission: Any) -> int:
    """The client's divided rollout (`samrollout_client.divided.move_target`): a running sequence whose
    current piece has ``after_tokens`` tokens moves to the instance streaming the fewest where there is
    room; there it re-prefills its prompt and tokens so far.  Returns how many moved."""
    moved = 0
    for seq in list(source.running):
        if seq.generated - seq.piece_start < after_tokens or seq.moves >= MAX_MOVES:
            continue
        targets = [t for t in instances if t is not source and _has_room(source, t, admission)]
        if not targets:
            continue
        target = min(targets, key=lambda t: len(t.running))
        source.running.remove(seq)
        if source.drafter is not None:
            source.drafter.remove(seq.index)
        admission.finished(source, seq)  # the source's server sees the piece end (cut short)
        seq.draft, seq.in_drafter = [], False
        seq.piece_start, seq.moves, seq.ready_s = seq.generated, seq.moves + 1, source.clock
        target.waiting.append(seq)
        moved += 1
    return moved


def _has_room(source: _Instance, target: _Instance, admission: Any) -> bool:
    """`samrollout_client.divided.has_room`: nothing waits on the target, and it streams fewer."""
    if target.waiting or admission.has_work(target):
        return False
    if len(source.running) - len(target.running) >= MOVE_MARGIN:
        return True
    source_waits = bool(source.waiting) or admission.has_work(source)
    return source_waits and len(target.running) < len(source.running)


def _draft(instance: _Instance) -> float:
    """Hand every running row's new tokens to the drafter and keep its drafts; the drafter's wall time."""
    rows = instance.running
    if instance.drafter is None or not rows:
        for seq in rows:
            seq.draft = []
        return 0.0
    ids = [seq.index for seq in rows]
    for seq in rows:
        if not seq.in_drafter:  # first step after (re)admission: start it in the drafter
            instance.drafter.add(seq.index, seq.group, seq.prompt)
            seq.in_drafter = True
    contexts = [seq.full[:seq.context] for seq in rows]  # views: no copy per step
    start = time.thread_time()  # CPU time: another process on the machine does not inflate the charge
    drafts = instance.drafter.step(ids, [seq.new_tokens for seq in rows], contexts, instance.k)
    elapsed = time.thread_time() - start
    for seq, draft in zip(rows, drafts, strict=True):
        room = len(seq.truth) - seq.generated
        seq.draft = list(draft[:instance.k]) if room > 0 else []
    return elapsed

