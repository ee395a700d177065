"""The rules of an RL loop's rollouts, written once: the client's partial rollout and the simulator both follow them.

Pure: no I/O, no clock, standard library only.  `samrollout_client.rollouts.partial.PartialRollout` applies them to real
requests; `samrollout.sim.rl_loop` applies them to simulated sequences, so that a projection calibrates the rules
the trainer runs, not a copy of them (tests/test_module_layering.py checks that both import this module).

- The loops a trainer runs and what each asks of a weight update (`LOOPS`, `in_flight_of`).
- How many groups a partial rollout keeps started (`concurrent_groups`: two batches by default).
- Staleness: how many versions a sample's oldest token lags the newest (`staleness`), and whether a
  finished sample may still be returned (`too_stale`, bound `DEFAULT_MAX_STALENESS`).
- Which complete groups a batch takes (`batch_order`: the stalest first, then in prompt order).
- When a divided rollout's sample moves to a less loaded endpoint (`MOVE_MARGIN`, `MAX_MOVES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, get_args

from samrollout_client.protocol.modes import InFlight

DEFAULT_MAX_STALENESS = 2
"""The default ``max_staleness``: the most versions a returned sample's oldest token may lag the newest.  With
two batches of groups in flight (the default), samples lag at most 2 nearly always; on bench/async_rollout.py
(bench/results/async-rollout-staleness-cpu.json) a bound of 2 cost nothing (1.48 samples/s against 1.46 unbounded,
no token discarded) while a bound of 1 cost 8% (1.35, 8,891 tokens discarded).  It keeps a looping response from
reaching the trainer many versions late; ``None`` sets no bound."""
BATCHES_IN_FLIGHT = 2
"""Batches of groups a partial rollout keeps started by default (`concurrent_groups`): while the trainer trains on
one, the next generates."""

MOVE_MARGIN = 2
"""A divided rollout's sample (`samrollout_client.rollouts.divided`), with nothing waiting on either side, moves only if
its endpoint streams this many more requests.

Two is the smallest margin that cannot bounce: after the move the target streams at most
as many as the source, so the sample has no reason to move back.
"""

MAX_MOVES = 4
"""Moves for load per sample, at most (continuations after a failure are not bounded by it)."""

def may_take_over(source_streaming: int, source_waiting: bool, target_streaming: int, target_waiting: bool) -> bool:
    """Whether a server streaming ``target_streaming`` samples may take over a divided rollout's sample from one
    streaming ``source_streaming``: nothing waits on the target, and the source streams `MOVE_MARGIN` more, or
    requests wait at the source and the target streams fewer.  The client (`rollouts.divided.has_room`) and the
    simulator (`samrollout.sim.rollout`) count streaming and waiting each their own way and ask this."""
    if target_waiting:
        return False
    if source_streaming - target_streaming >= MOVE_MARGIN:
        return True
    return source_waiting and target_streaming < source_streaming


Loop = Literal["sync-wait", "sync-abort", "async-continue"]
"""How a trainer's step gets its batch: wait for all its groups and update with nothing in flight
(``sync-wait``); over-sample, take the first groups done and abort the rest at the update (``sync-abort``); or a
partial rollout whose unfinished samples go on under each update (``async-continue``)."""
LOOPS: tuple[Loop, ...] = get_args(Loop)
LOOP_SHORT_NAMES: dict[str, Loop] = {"sync": "sync-wait", "sync-abort": "sync-abort", "async": "async-continue"}
"""The short names `samrollout simulate-rl --loops` takes (and prefixes its modes with)."""
KvOnUpdate = Literal["recompute", "keep"]
"""What an ``async-continue`` update does to the keys and values of the samples in flight."""
KV_ON_UPDATE: tuple[KvOnUpdate, ...] = get_args(KvOnUpdate)

_UPDATE_MODES: dict[tuple[Loop, KvOnUpdate], InFlight] = {
    ("sync-wait", "recompute"): "wait", ("sync-wait", "keep"): "wait",
    ("sync-abort", "recompute"): "abort", ("sync-abort", "keep"): "abort",
    ("async-continue", "recompute"): "continue", ("async-continue", "keep"): "continue-keep-kv",
}


def in_flight_of(loop: Loop, kv: KvOnUpdate = "recompute") -> InFlight:
    """The ``in_flight`` mode of ``loop``'s weight updates (``kv``: what a continuing update does to the KV)."""
    return _UPDATE_MODES[loop, kv]


def loop_mode(loop: Loop, kv: KvOnUpdate = "recompute") -> str:
    """The `LOOP_MODES` name of ``loop`` with ``kv``."""
    return f"{loop}-keep-kv" if in_flight_of(loop, kv) == "continue-keep-kv" else loop


LOOP_MODES: tuple[str, ...] = tuple(dict.fromkeys(loop_mode(loop, kv) for loop in LOOPS for kv in KV_ON_UPDATE))
"""Each loop with each way its updates treat the KV in flight (sync-wait, sync-abort, async-continue,
async-continue-keep-kv), as `bench/async_rollout.py --modes` names them."""


def concurrent_groups(batch_groups: int, max_concurrent_groups: int | None = None) -> int:
    """The groups a partial rollout keeps started: ``max_concurrent_groups``, by default `BATCHES_IN_FLIGHT`
    batches; ValueError if fewer than one batch."""
    concurrent = BATCHES_IN_FLIGHT * batch_groups if max_concurrent_groups is None else max_concurrent_groups
    if concurrent < batch_groups:
        raise ValueError(f"max_concurrent_groups ({concurrent}) must be at least batch_groups ({batch_groups})")
    return concurrent


def staleness(newest: int, oldest_token_version: int) -> int:
    """How many versions a sample lags: the newest version's place less that of its oldest token's version
    (places in the order the versions were served; 0: the newest weights sampled all of it)."""
    return newest - oldest_token_version


def too_stale(sample_staleness: int, max_staleness: int | None) -> bool:
    """Whether a finished sample this stale may not be returned (None: no bound): it is restarted from its prompt
    under the newest weights, or its group dropped."""
    return max_staleness is not None and sample_staleness > max_staleness


Group = TypeVar("Group")


def batch_order(ready: Sequence[Group], staleness_of: Callable[[Group], int],
                index_of: Callable[[Group], int]) -> list[Group]:
    """The complete groups in the order a batch takes them: the stalest first, then in prompt order."""
    return sorted(ready, key=lambda group: (-staleness_of(group), index_of(group)))
