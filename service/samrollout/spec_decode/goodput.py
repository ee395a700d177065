"""The adaptive drafting policy: each step, each row's draft source and length chosen for the batch's expected
tokens per second.

A draft is not free: every draft token is verified, and the step's time grows with the tokens verified.
So, per step, with reach_r[d] the chance that row r's first d draft tokens are all accepted and t(n) the
step's seconds when n draft tokens are verified in all, the policy picks lengths k_r maximising

    goodput = sum_r w_r * (1 + reach_r[1] + ... + reach_r[k_r]) / t(sum_r k_r)

where every row produces one token whatever is drafted (the bonus or the plain sample) and w_r weighs a
row (1; more for rows on a synchronous step's critical path, see `critical_weights`).  The native core does
the per-row work in one call (``service/csrc/goodput.hpp``): it scores every source's last candidate
against the tokens each row got, keeps acceptance by kind of match online, gives each row the source whose
candidate is expected to be accepted longest, and takes the best draft tokens in order of value while the
ratio improves.  This module supplies t(n) (`samrollout.spec_decode.step_cost`, learned from the engine's
own step times) and the weights.

What follows from it: a looping row (a long match accepted in full) drafts long at any batch size; a row
whose match is a guess drafts nothing; where steps are memory-bound (few rows) drafting is nearly free and
every row drafts what its match supports; where they are compute-bound only the surest drafts pay.  The
threshold of the published design is the step where drafting nothing wins for every row.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from samrollout.drafter import ChosenDrafts, SamDrafter
from samrollout.spec_decode.step_cost import StepCost

FloatArray = npt.NDArray[np.float64]


def longest_rows(output_lengths: Sequence[int], count: int) -> list[int]:
    """The ``count`` rows with the longest outputs so far that are longer than every row left out (rows that
    started together are no evidence of which runs longest); every row when there are no more than ``count``."""
    if len(output_lengths) <= count:
        return list(range(len(output_lengths)))
    lengths = np.asarray(output_lengths, dtype=np.int64)
    ranked = np.argsort(-lengths, kind="stable")
    boundary = lengths[ranked[count]]
    return [int(r) for r in ranked[:count] if lengths[r] > boundary]


def critical_weights(output_lengths: Sequence[int], rows: int, weight: float) -> FloatArray:
    """Row weights for a synchronous step's critical path: the `longest_rows` weigh ``weight``, the rest 1 (no
    weight at all while every row is among them).  A synchronous step ends with its longest response, so a
    token saved there is worth more than throughput elsewhere."""
    weights = np.ones(len(output_lengths))
    if rows > 0 and weight != 1.0 and len(output_lengths) > rows:
        weights[longest_rows(output_lengths, rows)] = weight
    return weights


@dataclass
class GoodputPolicy:
    """The adaptive policy's Python side: the step cost it learns, and one native call per step."""

    depth: int
    cost: StepCost = field(default_factory=StepCost)

    def step(self, drafter: SamDrafter, request_ids: Sequence[Hashable], new_tokens: Sequence[Sequence[int]],
             greedy: Sequence[bool], limits: Sequence[int], weights: FloatArray, context: float) -> ChosenDrafts:
        """Each row's draft (`SamDrafter.step_goodput`) for a step of these rows at mean context ``context``;
        ``limits[i]``: the most draft tokens row i may get (0: none)."""
        rows = len(request_ids)
        seconds = self.cost.seconds(rows, rows + np.arange(rows * self.depth + 1, dtype=np.float64), context)
        return drafter.step_goodput(request_ids, new_tokens, self.depth, np.asarray(greedy, dtype=np.uint8),
                                    np.asarray(limits, dtype=np.int32), np.asarray(weights, dtype=np.float64),
                                    seconds)
