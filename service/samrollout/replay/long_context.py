"""Drafter cost per step at long context (8K-32K tokens), where rollouts' tails live.

Each of a batch of rows gets L real trace tokens as its prompt, then the next tokens
are replayed for a fixed number of steps under the greedy oracle; the cost per
row-step is what a long response pays at every decode step of the tail.
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
            rows: int = 8, steps: int = 128, warmup: int = 16) -> list[LongContextCost]:
    """Per row-step drafter cost for a batch of ``rows`` long rows at each context length.

    Every row holds ``length`` real tokens (a different slice of the traces) before it
    starts decoding; the default of 8 rows is the tail batch at the published threshold.
    The first ``warmup`` steps are not timed (steady state is what a long tail pays).
    """
    out = []
    for length in lengths:
        span = (warmup + steps) * (k + 1) + 1
        tokens = concatenated_tokens(groups, length + rows * span)
        drafter = make()
        full, responses, position, pending = {}, {}, {}, {}
        for row in range(rows):
            # Row r's context is the first `length` tokens shifted by r: distinct, real text.
            start = row * span
            full[row] = tokens[start: start + length + span]
            drafter.add(row, row, full[row][:length])
            responses[row] = full[row][length:]
            position[row], pending[row] = 1, responses[row][:1].tolist()
        result = ReplayResult(drafter.name, k)
        elapsed = 0.0
        for step in range(warmup + steps):
            ids = list(range(rows))
            contexts = [full[r][: length + position[r]] for r in ids]
            new = [pending[r] for r in ids]
            begin = time.perf_counter()
            drafts = drafter.step(ids, new, contexts, k)
            if step >= warmup:
                elapsed += time.perf_counter() - begin
                result.row_steps += rows
            for r, draft in zip(ids, drafts, strict=True):
                verify_step(result, r, draft, responses, position, pending)
        memory = getattr(drafter, "memory_bytes", None)
        indexed = sum(length + position[r] for r in range(rows))
        per_token = memory() / indexed if memory else None
        for r in range(rows):
            drafter.remove(r)
        out.append(LongContextCost(drafter.name, length, 1e6 * elapsed / result.row_steps, per_token))
    return out
