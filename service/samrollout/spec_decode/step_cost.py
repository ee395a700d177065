"""What a verification step costs: its seconds as a function of the rows and the tokens verified, learned online.

The drafting policy (`samrollout.spec_decode.goodput`) weighs a draft's expected tokens against the step
time it adds, so it needs t(rows B, tokens verified N, mean context L).  Two parts:

- a **prior shape**: a measured cost table of the device where one exists (`TableShape`, the tables of
  ``bench/verify_cost.py``; `samrollout.sim.cost.CostTable`), else a generic compute-bound line
  (`LinearShape`: a fixed cost per step plus a cost per token verified and per token of context read);
- an **online correction**, fitted from the engine's own step times: per batch-size octave, the step time
  relative to the shape's plain decode step is fitted as ``u + v * r``, where ``r`` is the extra time the
  shape gives the drafts, relative to that plain step.  ``u`` is the level (how fast this device is), ``v``
  how much drafts really cost here.  Exponential forgetting follows drift (context growing, other load);
  each octave is shrunk toward the fit over all octaves, and that toward the shape (1, 1), so an octave
  with no measurements yet borrows what the others measured.

With a table from the device itself (the simulator) the fit stays at (1, 1); on a device with no table
(an Ascend NPU, a CPU) the line's level and slope are what the engine measured within a few dozen steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class CostTableLike(Protocol):
    """What `TableShape` reads of a measured table (`samrollout.sim.cost.CostTable`)."""

    def step_seconds_many(self, rows: int, tokens_per_row: npt.ArrayLike, context: float) -> FloatArray:
        """Step seconds at each number of tokens per row."""
        ...

    def q_knots(self) -> FloatArray:
        """The tokens per row the table measured (its curve is piecewise linear between them)."""
        ...


class StepShape(Protocol):
    """A prior step-time shape: seconds of a step of ``rows`` rows verifying ``tokens`` tokens in all."""

    def seconds(self, rows: int, tokens: FloatArray, context: float) -> FloatArray:
        """Seconds for each total of tokens verified (each >= rows), at mean context ``context``."""
        ...


@dataclass(frozen=True)
class LinearShape:
    """A compute-bound step: a fixed cost, a cost per token verified, and one per token of context per row.

    The defaults are a small model on a CPU (about 12 ms a step, 0.6 ms a token); only the proportions
    matter once the online fit has scaled them."""

    step_s: float = 0.012
    token_s: float = 0.0006
    context_token_s: float = 2e-8

    def seconds(self, rows: int, tokens: FloatArray, context: float) -> FloatArray:
        """``step_s + token_s * tokens + context_token_s * context * tokens``."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return self.step_s + tokens * (self.token_s + self.context_token_s * context)


@dataclass
class TableShape:
    """A measured cost table as the shape (`CostTable.step_seconds`, by tokens per row).

    The table's curve in q at a batch size and context is cached with the context rounded to
    ``context_step`` tokens: a step's context moves slowly, and the table is interpolated linearly anyway."""

    table: CostTableLike
    context_step: int = 256
    _curves: dict[tuple[int, int], tuple[FloatArray, FloatArray, float]] = field(default_factory=dict, repr=False)

    def seconds(self, rows: int, tokens: FloatArray, context: float) -> FloatArray:
        """The table at tokens per row ``tokens / rows``, piecewise linear between its measured q's."""
        knots, values, slope = self._curve(rows, context)
        qs = np.asarray(tokens, dtype=np.float64) / rows
        return np.where(qs > knots[-1], values[-1] + slope * (qs - knots[-1]), np.interp(qs, knots, values))

    def _curve(self, rows: int, context: float) -> tuple[FloatArray, FloatArray, float]:
        """The table's q knots, its seconds there and its slope past the last (never negative), cached."""
        key = (rows, int(context) // self.context_step)
        curve = self._curves.get(key)
        if curve is None:
            if len(self._curves) >= 1 << 14:
                self._curves.clear()
            knots = self.table.q_knots()
            values = self.table.step_seconds_many(rows, knots, (key[1] + 0.5) * self.context_step)
            slope = max(0.0, float((values[-1] - values[-2]) / (knots[-1] - knots[-2]))) if len(knots) > 1 else 0.0
            curve = self._curves[key] = (knots, values, slope)
        return curve


@dataclass
class _Fit:
    """Exponentially weighted least squares of z = u + v * r, shrunk toward a center with ``weight`` observations."""

    forget: float
    weight: float
    sums: FloatArray = field(default_factory=lambda: np.zeros(5))  # n, sum r, sum r^2, sum z, sum r z
    observations: int = 0

    def add(self, r: float, z: float) -> None:
        self.sums *= self.forget
        self.sums += (1.0, r, r * r, z, r * z)
        self.observations += 1

    def solve(self, center: tuple[float, float]) -> tuple[float, float]:
        n, sr, srr, sz, srz = (float(x) for x in self.sums)
        w = self.weight
        a, b, d = n + w, sr, srr + w  # the 2x2 normal equations [[a, b], [b, d]] (u, v) = (e, f)
        e, f = sz + w * center[0], srz + w * center[1]
        det = a * d - b * b
        return (d * e - b * f) / det, max(0.0, (a * f - b * e) / det)


@dataclass
class StepCost:
    """Step seconds from a prior shape corrected online by the engine's measured step times."""

    shape: StepShape = field(default_factory=LinearShape)
    forget: float = 0.98
    octaves: int = 12
    _overall: _Fit = field(init=False)
    _by_octave: list[_Fit] = field(init=False)
    _solved: dict[int, tuple[float, float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._overall = _Fit(self.forget, weight=1.0)
        self._by_octave = [_Fit(self.forget, weight=4.0) for _ in range(self.octaves)]

    def _octave(self, rows: int) -> int:
        return min(max(1, rows).bit_length() - 1, self.octaves - 1)

    def correction(self, rows: int) -> tuple[float, float]:
        """(u, v) at this batch size: level of a plain step and weight of the drafts' extra time."""
        octave = self._octave(rows)
        solved = self._solved.get(octave)
        if solved is None:
            overall = self._overall.solve((1.0, 1.0))
            solved = self._solved[octave] = self._by_octave[octave].solve(overall)
        return solved

    def seconds(self, rows: int, tokens: FloatArray, context: float) -> FloatArray:
        """Predicted seconds of a step of ``rows`` rows verifying each total of ``tokens`` (>= rows)."""
        shaped = self.shape.seconds(rows, np.concatenate([[float(rows)], tokens]), context)
        plain = shaped[0]
        u, v = self.correction(rows)
        return np.asarray(u * plain + v * (shaped[1:] - plain), dtype=np.float64)

    def observe(self, rows: int, tokens: int, context: float, seconds: float) -> None:
        """One measured decode step: ``rows`` rows verified ``tokens`` tokens in all and took ``seconds``."""
        if rows < 1 or seconds <= 0 or tokens < rows:
            return
        plain, verified = (float(x) for x in self.shape.seconds(rows, np.array([float(rows), float(tokens)]), context))
        if plain <= 0:
            return
        extra = verified - plain
        r, z = extra / plain, seconds / plain
        self._overall.add(r, z)
        self._by_octave[self._octave(rows)].add(r, z)
        self._solved.clear()

    def describe(self) -> dict[str, tuple[float, float, float]]:
        """(u, v, observations) per batch-size octave that has measurements ("<2": 1 row, "<4": 2-3, ...)."""
        return {f"<{1 << (o + 1)}": (*self.correction(1 << o), float(fit.observations))
                for o, fit in enumerate(self._by_octave) if fit.observations}


def cost_shape(prior: str) -> StepShape:
    """The prior shape a setting names: "linear" (`LinearShape`) or the path of a measured cost table."""
    if prior == "linear":
        return LinearShape()
    from samrollout.sim.cost import CostTable

    return TableShape(CostTable.load(prior))
