"""Drafter cost per step at long context (8K-32K tokens), where rollouts' tails live.

A context of L real trace tokens is given to the drafter as its prompt, then the
next tokens are replayed for a fixed number of steps under the greedy oracle; the
cost per step is what a long response pays at every decode step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from samrollout.replay.protocol import ReplayDrafter
from samrollout.replay.simulate import ReplayResult, verify_step
from samrollout.replay.traces import TraceGroup


@dataclass
class LongContextCost:
    """One drafter at one context length."""

    drafter: str
    context_tokens: int
    us_per_step: float
    bytes_per_token: float | None  # memory of the drafter's index per indexed token, where it reports it

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return self.__dict__.copy()


def concatenated_tokens(groups: list[TraceGroup], length: int) -> np.ndarray:
    """Real trace tokens, responses back to back (repeated if the traces are shorter)."""
    pieces = [r for g in groups for r in g.responses]
    if not pieces:
        raise ValueError("traces hold no responses")
    stream = np.concatenate(pieces)
    reps = -(-length // len(stream))
    return np.tile(stream, reps)[:length]


def measure(make: Callable[[], ReplayDrafter], groups: list[TraceGroup], lengths: list[int], k: int,
            steps: int = 256) -> list[LongContextCost]:
    """Per-step drafter cost for a single long row at each context length."""
    out = []
    for length in lengths:
        tokens = concatenated_tokens(groups, length + steps + 1)
        drafter = make()
        drafter.add(0, 0, tokens[:length])
        response = tokens[length:]
        result = ReplayResult(drafter.name, k, accepted_by_position=[0] * k, drafted_by_position=[0] * k)
        position, pending = {0: 1}, {0: response[:1]}
        responses = {0: response}
        elapsed = 0.0
        while position[0] < len(response) and result.row_steps < steps:
            context = tokens[: length + position[0]]
            start = time.perf_counter()
            drafts = drafter.step([0], [pending[0]], [context], k)
            elapsed += time.perf_counter() - start
            result.row_steps += 1
            verify_step(result, 0, np.asarray(drafts[0])[:k], responses, position, pending)
        memory = getattr(drafter, "memory_bytes", None)
        per_token = memory() / (length + position[0]) if memory else None
        drafter.remove(0)
        out.append(LongContextCost(drafter.name, length, 1e6 * elapsed / result.row_steps, per_token))
    return out
