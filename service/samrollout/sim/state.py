"""The simulator's state: a rollout's shape (`SimSettings`), one response being generated (`SimSequence`) and one
engine instance (`SimInstance`), shared by the one-step rollout (`samrollout.sim.rollout`), its admission
(`samrollout.sim.admission`) and the RL loop (`samrollout.sim.rl_loop`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from samrollout.replay.protocol import ReplayDrafter
from samrollout.server.settings import SchedulingPolicy


@dataclass(frozen=True)
class SimSettings:
    """The rollout's shape: slots and KV budget per instance, instances, scheduling, drafter-time charge."""

    slots: int = 64
    kv_tokens: int | None = None
    instances: int = 1
    scheduling: SchedulingPolicy = "fcfs"
    charge_drafter: bool = True
    drafter_time_scale: float = 1.0  # the drafter's measured CPU time is charged times this (0.5: a CPU twice as fast)
    tail_rows: int = 8
    divide_after_tokens: int | None = None  # the client's divided rollout across instances (None: off)


@dataclass(eq=False)
class SimSequence:
    """One response being generated: its recorded tokens (the truth it replays) and where it stands."""

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
    prompt_key: str = ""            # the prompt's identity across epochs (length history, history hits)
    first_version: int = -1         # the weight version that sampled its first token (-1: none yet)
    # A restarted sample replays its recorded tokens only as a stand-in for a new response of that length:
    # the new text is not in the trace, so nothing drafts for it (its first run is in every drafter's memory).
    rerun: bool = False
    full: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # prompt + response

    def __post_init__(self) -> None:
        self.full = np.concatenate([self.prompt, np.asarray(self.truth, dtype=np.int32)]).astype(np.int32)

    @property
    def context(self) -> int:
        """Tokens in the KV cache: prompt and output so far."""
        return len(self.prompt) + self.generated

    @property
    def done(self) -> bool:
        """Whether it has produced every recorded token."""
        return self.generated >= len(self.truth)


class SimInstance:
    """One engine: its slots, KV budget, running rows, clock and drafter."""

    def __init__(self, drafter: ReplayDrafter | None, k: int) -> None:
        self.drafter = drafter
        self.k = k
        self.clock = 0.0
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.admissions = 0
        if drafter is not None and hasattr(drafter, "clock"):
            drafter.clock = lambda: self.clock
