"""What a verification step costs: its seconds as a function of the rows and the tokens verified, learned online.

The drafting policy (`samrollout.spec_decode.goodput`) weighs a draft's expected tokens against the step
time it adds, so it needs t(rows B, tokens verified N, mean context L).  Two parts:

- a **prior shape**: a measured cost table of the device where one exists (`TableShape`, the tables of
  ``bench/verify_cost.py``; `samrollout.sim.cost.CostTable`), else a generic compute-bound line
  (`LinearShape`: a fixed cost per step plus a cost per token verified and per token of context read);
- an **online correction**, fitted from the engine's own step times: per batch-size octave, the step time
  relative to the shape's plain decode step is fitted as ``u + w * drafted + v * r``, where ``drafted`` is 1
  for a step that verifies any draft and ``r`` the extra time the shape gives the drafts, relative to that
  plain step.  ``u`` is the level (how fast this device is), ``w`` what switching to verification costs
  whatever the drafts (on vLLM's CPU backend, sampled requests' rejection sampling is most of a step), ``v``
  how much the draft tokens really cost here.  Exponential forgetting follows drift (context growing, other load);
  each octave is shrunk toward the fit over all octaves, and that toward the shape (1, 1), so an octave
  with no measurements yet borrows what the others measured.

With a table from the device itself (the simulator) the fit stays at (1, 0, 1); on a device with no table
(an Ascend NPU, a CPU) the line's level, switch cost and slope are what the engine measured within a few
dozen steps.  A switch cost the policy then avoids is measured again as the fit forgets it: the policy drafts
once more where its drafts are worth it, which is the exploration.
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

    @property
    def draft_weight(self) -> float:
        """The drafts' weight v the online fit starts from where it has not yet measured drafts."""
        ...


@dataclass(frozen=True)
class LinearShape:
    """A compute-bound step: a fixed cost, a cost per token verified, and one per token of context per row.

    The defaults are a small model on a CPU (about 12 ms a step, 0.6 ms a token); only the proportions
    matter once the online fit has scaled them."""

    step_s: float = 0.012
    token_s: float = 0.0006
    context_token_s: float = 2e-8
    # The drafts' weight v the online fit starts from and returns to where it has not measured drafts: 0, drafts
    # free until measured.  The line guesses a device it has never seen; starting from its own draft slope, a
    # batch size where that slope says drafting does not pay is never drafted at, so never measured (on an
    # H100 the line's slope is about 40x the truth at 32 rows).  A few drafted steps measure v.
    draft_weight: float = 0.0

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
    draft_weight: float = 1.0  # a measured table's draft slope is the device's: the fit starts from it
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


Correction = tuple[float, float, float]  # (u, w, v): see StepCost
# How strongly each of (u, w, v) is held to its center, relative to the fit's weight: the switch cost needs
# steps with and without drafts to tell it from the level, and stays near its center until both are seen.
SHRINK = np.array([1.0, 4.0, 1.0])
OUTLIER_SPREADS = 4.0  # a step further off the fit than this many mean residuals is clipped to it
MIN_SPREAD_OBSERVATIONS = 16  # observations before outliers are clipped


@dataclass
class _Fit:
    """Exponentially weighted least squares of z = u + w * drafted + v * r (drafted: 1 where any row verified a
    draft), shrunk toward a center with ``weight`` observations."""

    forget: float
    weight: float
    gram: FloatArray = field(default_factory=lambda: np.zeros((3, 3)))
    moment: FloatArray = field(default_factory=lambda: np.zeros(3))
    observations: int = 0
    spread: float = 0.0  # a moving mean of the absolute residual, against which outliers are clipped

    def add(self, drafted: float, r: float, z: float, predicted: float) -> None:
        """One observation; a step far off the fit (another process took the core, a stall) counts as at most
        `OUTLIER_SPREADS` spreads off it, so one stall does not move the fit."""
        residual = z - predicted
        if self.observations >= MIN_SPREAD_OBSERVATIONS and self.spread > 0:
            limit = OUTLIER_SPREADS * self.spread
            z = predicted + max(-limit, min(limit, residual))
        self.spread = abs(residual) if self.observations == 0 else \
            0.95 * self.spread + 0.05 * min(abs(residual), OUTLIER_SPREADS * self.spread or abs(residual))
        x = np.array([1.0, drafted, r])
        self.gram = self.forget * self.gram + np.outer(x, x)
        self.moment = self.forget * self.moment + z * x
        self.observations += 1

    def solve(self, center: Correction) -> Correction:
        ridge = self.weight * SHRINK
        u, w, v = np.linalg.solve(self.gram + np.diag(ridge), self.moment + ridge * np.array(center))
        return float(u), max(0.0, float(w)), max(0.0, float(v))


@dataclass
class StepCost:
    """Step seconds from a prior shape corrected online by the engine's measured step times."""

    shape: StepShape = field(default_factory=LinearShape)
    forget: float = 0.98
    octaves: int = 12
    _overall: _Fit = field(init=False)
    _by_octave: list[_Fit] = field(init=False)
    _solved: dict[int, Correction] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._overall = _Fit(self.forget, weight=1.0)
        self._by_octave = [_Fit(self.forget, weight=4.0) for _ in range(self.octaves)]

    def _octave(self, rows: int) -> int:
        return min(max(1, rows).bit_length() - 1, self.octaves - 1)

    def correction(self, rows: int) -> Correction:
        """(u, w, v) at this batch size: the level of a plain step, the switch cost of a step that verifies any
        draft (both relative to the shape's plain step), and the weight of the drafts' extra time."""
        octave = self._octave(rows)
        solved = self._solved.get(octave)
        if solved is None:
            overall = self._overall.solve((1.0, 0.0, self.shape.draft_weight))
            solved = self._solved[octave] = self._by_octave[octave].solve(overall)
        return solved

    def seconds(self, rows: int, tokens: FloatArray, context: float) -> FloatArray:
        """Predicted seconds of a step of ``rows`` rows verifying each total of ``tokens`` (>= rows)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        shaped = self.shape.seconds(rows, np.concatenate([[float(rows)], tokens]), context)
        plain = shaped[0]
        u, w, v = self.correction(rows)
        return np.asarray(u * plain + w * plain * (tokens > rows) + v * (shaped[1:] - plain), dtype=np.float64)

    def observe(self, rows: int, tokens: int, context: float, seconds: float) -> None:
        """One measured decode step: ``rows`` rows verified ``tokens`` tokens in all and took ``seconds``."""
        if rows < 1 or seconds <= 0 or tokens < rows:
            return
        plain, verified = (float(x) for x in self.shape.seconds(rows, np.array([float(rows), float(tokens)]), context))
        if plain <= 0:
            return
        extra = verified - plain
        drafted, r, z = float(tokens > rows), extra / plain, seconds / plain
        u, w, v = self.correction(rows)
        predicted = u + w * drafted + v * r
        self._overall.add(drafted, r, z, predicted)
        self._by_octave[self._octave(rows)].add(drafted, r, z, predicted)
        self._solved.clear()

    def describe(self) -> dict[str, tuple[float, float, float, float]]:
        """(u, w, v, observations) per batch-size octave that has measurements ("<2": 1 row, "<4": 2-3, ...)."""
        return {f"<{1 << (o + 1)}": (*self.correction(1 << o), float(fit.observations))
                for o, fit in enumerate(self._by_octave) if fit.observations}


def cost_shape(prior: str) -> StepShape:
    """The prior shape a setting names: "linear" (`LinearShape`) or the path of a measured cost table."""
    if prior == "linear":
        return LinearShape()
    from samrollout.sim.cost import CostTable

    return TableShape(CostTable.load(prior))
