"""A simulated RL loop: S trainer steps over a prompt set, on N engine instances, with training and weight updates.

Each instance is the one-step simulator's engine (`samrollout.sim.engine_step`): its own slots, KV budget,
drafter and length-aware scheduler, kept across steps, so an instance drafts from and predicts with only
what ran on it (cross-epoch history, vLLM `suffix`'s global cache, the length predictor).  Groups are placed
by the trainer client's own placement policies (`samrollout_client.placement`): ``affine`` (rendezvous
hashing of the prompt with bounded loads) or ``least-outstanding``.

The prompt stream (`epoch_stream`) is every prompt of the trace files once per epoch; epoch e of a prompt is
the e-th of ``epochs`` contiguous chunks of its recorded responses (Sky-T1's are its checkpoints in order:
successive policies), so no response is ever its own history and none is copied.

Loops (as `bench/async_rollout.py` runs them against a real server):

- ``sync-wait``: a step places ``batch_groups`` groups, waits for all, trains (``train_s``), then updates the
  weights (nothing in flight).
- ``sync-abort``: a step places ``ceil(batch_groups * (1 + oversample))`` groups and takes the first
  ``batch_groups`` to complete; the rest run on through training and the transfer, then the update aborts
  them (their tokens are discarded).
- ``async-continue``: `samrollout_client.rollouts.partial.PartialRollout` (up to ``max_concurrent_groups`` held, default
  two batches; a batch is the first ``batch_groups`` complete groups, stalest first; a new prompt starts
  whenever a group is returned); unfinished samples run on through training and the update (``continue``,
  their KV recomputed or kept); a finished sample whose oldest token lags more than ``max_staleness``
  versions is restarted from its prompt on its group's instance (its tokens discarded).

A weight update costs (`UpdateCosts`): the transfer of the checkpoint, during which the engines keep going
(none for a shared disk; the checkpoint once per server over the trainer's link for ``push``, once for
``push-fanout``); the pause, when no engine steps (a shared-disk read, or the load of the staged files); and
for ``continue`` with ``kv="recompute"`` the prefill of every token in flight, on each instance, at the cost
table's prefill rate.  The trainer's clock: a step ends when its update is done; samples/s is the samples
handed to the trainer over the time its S steps took.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from samrollout.replay.protocol import ReplayDrafter
from samrollout.replay.traces import TraceGroup
from samrollout.sim.admission import Admission
from samrollout.sim.cost import CostTable
from samrollout.sim.engine_step import EngineCounters, advance
from samrollout.sim.priors import fit_summary
from samrollout.sim.state import SimInstance, SimSequence, SimSettings
from samrollout_client.placement import GroupDemand, LengthHistory, place_groups, placement_policy
from samrollout_client.rollout_rules import (
    DEFAULT_MAX_STALENESS,
    LOOPS,
    KvOnUpdate,
    Loop,
    batch_order,
    concurrent_groups,
    staleness,
    too_stale,
)

WeightTransfer = Literal["shared-disk", "push", "push-fanout"]
WEIGHT_TRANSFERS: tuple[WeightTransfer, ...] = get_args(WeightTransfer)
SimPlacement = Literal["affine", "least-outstanding"]
SIM_PLACEMENTS: tuple[SimPlacement, ...] = get_args(SimPlacement)


@dataclass(frozen=True)
class LoopGroup:
    """One prompt's group in one epoch: the responses it replays."""

    stream_index: int
    prompt_index: int
    epoch: int
    prompt: np.ndarray
    responses: tuple[np.ndarray, ...]
    home: int | None = None  # the instance it must run on (a recorded run's placement); None: placement decides


def epoch_stream(groups: Sequence[TraceGroup], epochs: int, shuffle_seed: int | None = 0) -> list[LoopGroup]:
    """Every prompt once per epoch, epoch by epoch; epoch e replays the e-th of ``epochs`` contiguous chunks of
    the prompt's responses (in recorded order).  A prompt with fewer responses than epochs skips the empty ones.

    Each epoch after the first visits the prompts in a new order (seeded by ``shuffle_seed``; None: file
    order every epoch), as trainers' data loaders shuffle: placement must not find a prompt's server by
    the accident of a repeated order."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    chunks = [np.array_split(np.arange(len(g.responses)), epochs) for g in groups]
    rng = np.random.default_rng(shuffle_seed)
    stream: list[LoopGroup] = []
    for epoch in range(epochs):
        order = range(len(groups)) if shuffle_seed is None or epoch == 0 else rng.permutation(len(groups))
        for p in order:
            picked = tuple(groups[p].responses[i] for i in chunks[p][epoch] if len(groups[p].responses[i]))
            if picked:
                stream.append(LoopGroup(len(stream), int(p), epoch, groups[p].prompt, picked))
    return stream


@dataclass(frozen=True)
class UpdateCosts:
    """What one weight update costs, by how the checkpoint reaches the servers (see the module docstring)."""

    checkpoint_bytes: float = 16e9
    transfer: WeightTransfer = "shared-disk"
    link_gbit_s: float = 25.0     # the trainer's link (push)
    disk_gbyte_s: float = 2.0     # a server's read of the checkpoint from the shared disk, in the pause
    load_gbyte_s: float = 10.0    # a server's load of staged (pushed) files, in the pause
    kv: KvOnUpdate = "recompute"  # continue updates: prefill the tokens in flight again, or keep their KV

    def transfer_s(self, servers: int) -> float:
        """Seconds the checkpoint takes to reach every server while the engines run on."""
        if self.transfer == "shared-disk":
            return 0.0
        copies = servers if self.transfer == "push" else 1
        return copies * self.checkpoint_bytes * 8 / (self.link_gbit_s * 1e9)

    def pause_s(self) -> float:
        """Seconds every engine stands still while the weights load."""
        rate = self.disk_gbyte_s if self.transfer == "shared-disk" else self.load_gbyte_s
        return self.checkpoint_bytes / (rate * 1e9)


@dataclass(frozen=True)
class LoopSettings:
    """The trainer's loop: how many steps, how big a batch, how long training takes, how updates go."""

    loop: Loop
    steps: int
    batch_groups: int
    train_s: float = 0.0
    oversample: float = 0.5                    # sync-abort
    max_staleness: int | None = DEFAULT_MAX_STALENESS  # async-continue (None: no bound); the client's default
    max_concurrent_groups: int | None = None   # async-continue (None: two batches)
    placement: SimPlacement = "affine"
    updates: UpdateCosts = field(default_factory=UpdateCosts)


@dataclass
class LoopResult(EngineCounters):
    """What one simulated RL loop delivered to the trainer, and at what cost."""

    loop: str = ""
    samples: int = 0
    wall_s: float = 0.0
    useful_tokens: int = 0
    discarded_tokens: int = 0
    recomputed_tokens: int = 0
    update_s: float = 0.0                 # on the trainer's clock: transfers and pauses
    restarted_samples: int = 0
    groups_placed: int = 0
    history_groups: int = 0               # groups whose prompt had run to its end before, on any instance
    history_hits: int = 0                 # of those, groups placed on an instance where it had
    staleness: Counter[int] = field(default_factory=Counter)
    step_rollout_s: list[float] = field(default_factory=list)  # per step: how long the trainer waited for it
    step_end_s: list[float] = field(default_factory=list)      # per step: when its update was done
    step_samples: list[int] = field(default_factory=list)      # per step: samples handed over
    step_tokens: list[int] = field(default_factory=list)       # per step: their response tokens

    @property
    def samples_per_s(self) -> float:
        """Samples handed to the trainer per second of its loop (rollouts, training and updates)."""
        return self.samples / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Response tokens handed to the trainer per second of its loop."""
        return self.useful_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def steady_samples_per_s(self) -> float:
        """`samples_per_s` without the first step: an asynchronous loop's first batch waits as a synchronous
        step does (nothing was in flight before it), a cost a long run pays once."""
        if len(self.step_end_s) < 2:
            return self.samples_per_s
        return sum(self.step_samples[1:]) / (self.step_end_s[-1] - self.step_end_s[0])

    @property
    def steady_tokens_per_s(self) -> float:
        """`tokens_per_s` without the first step (see `steady_samples_per_s`)."""
        if len(self.step_end_s) < 2:
            return self.tokens_per_s
        return sum(self.step_tokens[1:]) / (self.step_end_s[-1] - self.step_end_s[0])

    @property
    def mean_length(self) -> float:
        """Mean response length, in tokens, of the samples handed to the trainer."""
        return self.useful_tokens / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report: the whole run and its steady state (the first step left out)."""
        return {"samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
                "mean_length": self.mean_length,
                "steady": {"samples_per_s": self.steady_samples_per_s, "tokens_per_s": self.steady_tokens_per_s,
                           "steps": max(0, len(self.step_end_s) - 1)},
                "steady_samples_per_s": self.steady_samples_per_s,
                "step_cost_fit": fit_summary(self.step_cost_fit),
                "samples": self.samples, "wall_s": self.wall_s, "step_end_s": self.step_end_s,
                "step_samples": self.step_samples, "step_tokens": self.step_tokens,
                "useful_tokens": self.useful_tokens, "discarded_tokens": self.discarded_tokens,
                "recomputed_tokens": self.recomputed_tokens, "update_s": self.update_s,
                "restarted_samples": self.restarted_samples,
                "history_hit_rate": self.history_hits / self.history_groups if self.history_groups else 0.0,
                "history_hits": self.history_hits, "history_groups": self.history_groups,
                "groups_placed": self.groups_placed,
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                "step_rollout_s": self.step_rollout_s, "steps": self.steps,
                "mean_acceptance_length": self.mean_acceptance_length, "drafted": self.drafted,
                "accepted": self.accepted, "preemptions": self.preemptions, "drafter_s": self.drafter_s}


@dataclass(eq=False)
class _Held:
    """A group placed and not yet returned or given up."""

    source: LoopGroup
    instance: SimInstance
    sequences: list[SimSequence]

    @property
    def complete(self) -> bool:
        return all(seq.done for seq in self.sequences)

    def staleness(self, version: int) -> int:
        """The largest lag of its finished samples' oldest tokens behind ``version``."""
        return max((staleness(version, seq.first_version) for seq in self.sequences if seq.done), default=0)


class _Cluster:
    """N instances, their admission, placement and weight version; steps them in clock order."""

    def __init__(self, drafter_factory: Callable[[], ReplayDrafter] | None, k: int, cost: CostTable,
                 sim: SimSettings, placement: SimPlacement, result: LoopResult) -> None:
        self.instances = [SimInstance(drafter_factory() if drafter_factory else None, k)
                          for _ in range(sim.instances)]
        self.names = [f"instance-{i}" for i in range(sim.instances)]
        self.ran_prompts: list[set[int]] = [set() for _ in self.instances]
        self.cost, self.sim, self.placement, self.result = cost, sim, placement, result
        self.policy = placement_policy(placement)
        self.admission = Admission(sim)
        self.version = 0
        self._next_index = 0
        self._held_of: dict[int, _Held] = {}
        self.lengths = LengthHistory()  # the client's: response lengths of the groups it was handed

    def busy(self, instance: SimInstance) -> bool:
        """Whether the instance has sequences to run."""
        return bool(instance.running or instance.waiting or self.admission.has_work(instance))

    def outstanding(self, instance: SimInstance) -> int:
        """Sequences placed on the instance and not finished (the client's requests in flight there)."""
        held_here = {id(held): held for held in self._held_of.values() if held.instance is instance}
        return sum(1 for held in held_here.values() for seq in held.sequences if not seq.done)

    def place_batch(self, sources: Sequence[LoopGroup], now: float, in_flight: float | None = None) -> list[_Held]:
        """Start these groups at time ``now``, placed as the client places a batch (``affine``: the load bound
        shared out over the whole batch, or over ``in_flight`` when that is more); count history hits."""
        return [self._start(source, target, now) for source, target in
                zip(sources, self._targets(sources, in_flight), strict=True)]

    def _targets(self, sources: Sequence[LoopGroup], in_flight: float | None) -> list[int]:
        """The instance of each group: its recorded home, else the client's placement (`place_groups`: a batch as
        a whole, weighed by the lengths it was handed before; a partial rollout's groups one by one, the bound
        shared out over ``in_flight``; groups beside a recorded home one by one)."""
        groups = [GroupDemand(_identity(s), float(len(s.responses)), self.lengths.predict(_identity(s)))
                  for s in sources]
        return place_groups(self.policy, groups, self.names, [float(self.outstanding(i)) for i in self.instances],
                            in_flight, [s.home for s in sources])

    def _start(self, source: LoopGroup, target: int, now: float) -> _Held:
        """Start a group at time ``now`` on instance ``target``; count a history hit."""
        instance = self.instances[target]
        self.result.groups_placed += 1
        if any(source.prompt_index in ran for ran in self.ran_prompts):
            self.result.history_groups += 1
            self.result.history_hits += source.prompt_index in self.ran_prompts[target]
        if not self.busy(instance):
            instance.clock = max(instance.clock, now)
        sequences = []
        for response in source.responses:
            seq = SimSequence(self._next_index, source.stream_index, source.prompt, response.tolist(),
                              prompt_key=f"p{source.prompt_index}", ready_s=now)
            self._next_index += 1
            sequences.append(seq)
        held = _Held(source, instance, sequences)
        for seq in sequences:
            self._held_of[seq.index] = held
        self.admission.enqueue(instance, sequences, f"g{source.stream_index}")
        self.admission.release(instance)
        return held

    def forget(self, held: _Held) -> None:
        """The group was returned or given up: its sequences are no longer this client's (the client remembers
        the lengths of those that finished, as `samrollout_client.client.AsyncRolloutClient.generate` does)."""
        lengths = [len(seq.truth) for seq in held.sequences if seq.done]
        if lengths:
            self.lengths.record(_identity(held.source), lengths)
        for seq in held.sequences:
            self._held_of.pop(seq.index, None)

    def step(self, horizon: float | None = None) -> list[SimSequence] | None:
        """One engine step on the busy instance furthest behind (only those before ``horizon``); the sequences
        it finished, or None when no instance has work before the horizon."""
        busy = [i for i in self.instances if self.busy(i) and (horizon is None or i.clock < horizon)]
        if not busy:
            return None
        instance = min(busy, key=lambda i: i.clock)
        finished = advance(instance, self.sim, self.cost, self.admission, self.result, self.version)
        if finished:
            self.ran_prompts[self.instances.index(instance)].update(
                self._held_of[seq.index].source.prompt_index for seq in finished if seq.index in self._held_of)
        return finished

    def run_to(self, horizon: float, on_finish: Callable[[list[SimSequence]], None]) -> None:
        """Step every instance with work up to ``horizon`` (each stops at its first step boundary past it)."""
        while (finished := self.step(horizon)) is not None:
            on_finish(finished)

    def abort(self, seq: SimSequence, instance: SimInstance) -> int:
        """End ``seq`` where it is (queued or running) as the server's abort does; the tokens it had."""
        if seq in instance.running:
            instance.running.remove(seq)
        elif seq in instance.waiting:
            instance.waiting.remove(seq)
        if instance.drafter is not None and seq.in_drafter:
            instance.drafter.remove(seq.index)
        self.admission.cancel(instance, seq)
        had = seq.generated
        seq.generated, seq.draft, seq.in_drafter, seq.first_version = 0, [], False, -1
        return had

    def update(self, at_s: float, costs: UpdateCosts, kv_in_flight: bool) -> float:
        """A weight update landing at ``at_s``: every instance pauses (and recomputes the KV of its running rows
        when ``kv_in_flight`` and not kept); the version moves on.  Returns when the trainer's call returns."""
        pause = costs.pause_s()
        for instance in self.instances:
            instance.clock = max(instance.clock, at_s) + pause
            if kv_in_flight and costs.kv == "recompute" and instance.running:
                tokens = sum(seq.context for seq in instance.running)
                self.result.recomputed_tokens += tokens
                instance.clock += self.cost.prefill_seconds(tokens, float(tokens))
            for seq in instance.running:
                seq.draft = []  # the drafters start again on the new weights
        self.version += 1
        return at_s + pause


def _identity(source: LoopGroup) -> str:
    """What placement knows a prompt by (the client hashes the prompt's identity; the simulator its index)."""
    return f"p{source.prompt_index}"


def groups_sent(loop: LoopSettings) -> int:
    """Groups a synchronous step places: the batch, or (``sync-abort``) the batch and its over-sample."""
    return loop.batch_groups if loop.loop != "sync-abort" else math.ceil(loop.batch_groups * (1 + loop.oversample))


def simulate_loop(stream: Sequence[LoopGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
                  cost: CostTable, sim: SimSettings, loop: LoopSettings, mode: str = "") -> LoopResult:
    """Run ``loop.steps`` trainer steps of ``loop.loop`` over ``stream``; what the trainer got and when."""
    if loop.loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop.loop!r}")
    if loop.placement not in SIM_PLACEMENTS:
        raise ValueError(f"placement must be one of {SIM_PLACEMENTS}, got {loop.placement!r}")
    runner = _run_async if loop.loop == "async-continue" else _run_sync
    return asyncio.run(runner(stream, drafter_factory, k, cost, sim, loop, mode))


async def _run_sync(stream: Sequence[LoopGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
                    cost: CostTable, sim: SimSettings, loop: LoopSettings, mode: str) -> LoopResult:
    # Inside an event loop: the length-aware scheduler is the server's own, which hands out futures.
    result = LoopResult(loop=mode or loop.loop)
    cluster = _Cluster(drafter_factory, k, cost, sim, loop.placement, result)
    sent = groups_sent(loop)
    now, taken = 0.0, 0
    for _ in range(loop.steps):
        if taken >= len(stream):
            break
        held = cluster.place_batch(stream[taken:taken + sent], now)
        taken += len(held)
        complete: list[_Held] = []
        done_s = now
        while len(complete) < min(loop.batch_groups, len(held)):
            finished = cluster.step()
            if finished is None:
                break
            newly = [h for h in held if h not in complete and h.complete]
            complete += newly
            if newly:
                done_s = max(seq.finish_s for h in newly for seq in h.sequences)
        batch = complete[:loop.batch_groups]
        _hand_over(result, batch, cluster.version)
        result.step_rollout_s.append(done_s - now)
        update_at = done_s + loop.train_s + loop.updates.transfer_s(sim.instances)
        cluster.run_to(update_at, lambda _finished: None)
        for group in held:
            if group not in batch:
                result.discarded_tokens += sum(cluster.abort(seq, group.instance) if not seq.done
                                               else len(seq.truth) for seq in group.sequences)
            cluster.forget(group)
        now = cluster.update(update_at, loop.updates, kv_in_flight=False)
        result.update_s += now - done_s - loop.train_s
        result.step_end_s.append(now)
        result.step_samples.append(sum(len(group.sequences) for group in batch))
        result.step_tokens.append(sum(len(seq.truth) for group in batch for seq in group.sequences))
    result.wall_s = now
    return result


def _hand_over(result: LoopResult, batch: Sequence[_Held], version: int) -> None:
    """The trainer takes these groups: count their samples, tokens and staleness."""
    for group in batch:
        for seq in group.sequences:
            result.samples += 1
            result.useful_tokens += len(seq.truth)
            result.staleness[version - seq.first_version] += 1


async def _run_async(stream: Sequence[LoopGroup], drafter_factory: Callable[[], ReplayDrafter] | None, k: int,
                     cost: CostTable, sim: SimSettings, loop: LoopSettings, mode: str) -> LoopResult:
    result = LoopResult(loop=mode or loop.loop)
    cluster = _Cluster(drafter_factory, k, cost, sim, loop.placement, result)
    rollout = _PartialRollout(cluster, stream, loop)
    now = 0.0
    rollout.fill(now)
    for _ in range(loop.steps):
        ready_s = rollout.wait_for_batch(now)
        if ready_s is None:
            break
        batch = rollout.take_batch()
        _hand_over(result, batch, cluster.version)
        result.step_rollout_s.append(ready_s - now)
        rollout.fill(ready_s)
        update_at = ready_s + loop.train_s + loop.updates.transfer_s(sim.instances)
        cluster.run_to(update_at, rollout.judge_finished)
        now = cluster.update(update_at, loop.updates, kv_in_flight=True)
        rollout.judge_all(now)
        result.update_s += now - ready_s - loop.train_s
        result.step_end_s.append(now)
        result.step_samples.append(sum(len(group.sequences) for group in batch))
        result.step_tokens.append(sum(len(seq.truth) for group in batch for seq in group.sequences))
    result.wall_s = now
    return result


class _PartialRollout:
    """`samrollout_client.rollouts.partial.PartialRollout`'s rules (`samrollout_client.rollout_rules`) on the simulated
    cluster."""

    def __init__(self, cluster: _Cluster, stream: Sequence[LoopGroup], loop: LoopSettings) -> None:
        self.cluster, self.stream, self.loop = cluster, stream, loop
        self.concurrent = concurrent_groups(loop.batch_groups, loop.max_concurrent_groups or None)
        self.held: list[_Held] = []
        self.taken = 0

    def fill(self, now: float) -> None:
        """Start groups from the stream until ``max_concurrent_groups`` are held (the load bound shared out over
        what the rollout keeps in flight, as the client's partial rollout places them)."""
        count = min(self.concurrent - len(self.held), len(self.stream) - self.taken)
        if count <= 0:
            return
        sources = self.stream[self.taken:self.taken + count]
        group_size = max(len(source.responses) for source in sources)
        for source in sources:  # one at a time, as the client starts them
            self.held += self.cluster.place_batch([source], now, in_flight=self.concurrent * group_size)
        self.taken += count

    def ready(self) -> list[_Held]:
        """The complete groups."""
        return [h for h in self.held if h.complete]

    def wait_for_batch(self, now: float) -> float | None:
        """Step the engines until a batch is complete; when it was (None: the stream ran dry first)."""
        want = self.loop.batch_groups
        ready_s = now
        ready = len(self.ready())
        while ready < want:
            finished = self.cluster.step()
            if finished is None:
                return None
            if not finished:
                continue
            self.judge_finished(finished)
            ready = len(self.ready())
            if finished:
                ready_s = max(ready_s, max(seq.finish_s for seq in finished))
        return ready_s

    def take_batch(self) -> list[_Held]:
        """The first ``batch_groups`` complete groups, the stalest first (then in stream order)."""
        version = self.cluster.version
        ready = batch_order(self.ready(), lambda h: h.staleness(version), lambda h: h.source.stream_index)
        batch = ready[:self.loop.batch_groups]
        for group in batch:
            self.held.remove(group)
            self.cluster.forget(group)
        return batch

    def judge_finished(self, finished: list[SimSequence]) -> None:
        """Judge the groups of these finished sequences as they come back (a restart discards the sample's tokens)."""
        if not finished:
            return
        now = max(seq.finish_s for seq in finished)
        indices = {seq.index for seq in finished}
        for group in [h for h in self.held if any(seq.index in indices for seq in h.sequences)]:
            self._judge(group, now)

    def judge_all(self, now: float) -> None:
        """A new version: judge every held group's finished samples again."""
        for group in self.held:
            self._judge(group, now)

    def _judge(self, group: _Held, now: float) -> None:
        bound = self.loop.max_staleness
        if bound is None:
            return
        version = self.cluster.version
        for seq in group.sequences:
            if seq.done and too_stale(staleness(version, seq.first_version), bound):
                result = self.cluster.result
                result.restarted_samples += 1
                result.discarded_tokens += len(seq.truth)
                self.cluster.abort(seq, group.instance)
                seq.group = -1 - result.restarted_samples  # a fresh sibling group in the drafter: not its old text
                seq.rerun = True
                seq.ready_s = now
                self.cluster.admission.enqueue(group.instance, [seq], f"r{seq.index}")
                self.cluster.admission.release(group.instance)
