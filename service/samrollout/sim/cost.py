"""Step-time tables of the target model for the rollout simulator: t(running rows B, context L, tokens per row q).

    table = CostTable.load("bench/results/verify-cost-h100.json")
    table.step_seconds(rows=12, tokens_per_row=2.5, context=3000)  # one decode/verify step, seconds
    table.prefill_seconds(tokens=512, context=0)                   # what prefilling 512 tokens adds to it

A table is the JSON that ``bench/verify_cost.py`` (plain PyTorch) or ``bench/engine_cost.py`` (the
vLLM engine) writes: ``points`` of ``{"L", "B", "t_ms": {"<q>": ms, ...}, "status"}``, of which only
the points whose status is ``"ok"`` count; q = 1 + draft tokens verified per row.

Interpolation rule (what `CostTable.step_seconds` computes between and beyond the measured points):

a) At each measured length Lj: piecewise-linear in q between the measured q's at fixed B (beyond the
   largest q: linear extrapolation from the last two q's; below the smallest: clamped to it, q = 1),
   then piecewise-linear in B between the measured B's (beyond the largest B measured at Lj: linear
   extrapolation from the last two B's measured there; below the smallest: clamped to it).
b) Across lengths: linear interpolation in L between the two measured lengths bracketing L; beyond the
   largest, linear extrapolation from the two largest lengths (attention reads grow linearly with
   context); below the smallest, the smallest length's value (clamped).  A length with fewer than 2
   measured batch sizes is ignored.
c) No extrapolation (in q, B or L) goes below the last measured value it extends: where noise makes the
   last two points slope down, the curve goes on flat from the last one.

Prefill rule (`CostTable.prefill_seconds`): a step that also prefills n prompt tokens takes n times the
marginal per-token time longer, where the marginal per-token time is the slope of t against B*q
between the two measured points with the largest B*q at the smallest measured length (the
compute-bound rate; at equal B*q the slower point counts; a negative slope counts as 0).  It does not
depend on the context.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Grid = tuple[float, ...]
FloatArray = npt.NDArray[np.float64]


def _bracket(xs: Grid, x: float) -> tuple[int, int, float]:
    """(lo, hi, w) with value = (1 - w) * y[lo] + w * y[hi]: clamped below xs[0], extrapolated (w > 1) above xs[-1]."""
    last = len(xs) - 1
    if last == 0 or x <= xs[0]:
        return 0, 0, 0.0
    hi = min(bisect.bisect_left(xs, x), last)
    lo = hi - 1
    return lo, hi, (x - xs[lo]) / (xs[hi] - xs[lo])


def _mix(y_lo: float, y_hi: float, w: float) -> float:
    """The weighted value of `_bracket`; an extrapolation (w > 1) never below y_hi (rule c)."""
    value = (1.0 - w) * y_lo + w * y_hi
    return y_hi if w > 1.0 and value < y_hi else value


def _along(xs: Grid, ys: Grid, x: float) -> float:
    """Piecewise-linear ys(x) by the rule: clamped below, extrapolated above from the last two points."""
    lo, hi, w = _bracket(xs, x)
    return ys[lo] if w == 0.0 else _mix(ys[lo], ys[hi], w)


@dataclass(frozen=True)
class LengthSlice:
    """The measurements at one context length: per measured batch size, step seconds against q."""

    length: float
    batches: Grid            # measured B, ascending
    qs: tuple[Grid, ...]     # per batch: measured q, ascending
    seconds: tuple[Grid, ...]  # per batch: step seconds at those q

    def at(self, rows: float, tokens_per_row: float) -> float:
        """Step seconds at this length (rule a): in q at the bracketing batch sizes, then in B."""
        lo, hi, w = _bracket(self.batches, rows)
        t_lo = _along(self.qs[lo], self.seconds[lo], tokens_per_row)
        if w == 0.0:
            return t_lo
        return _mix(t_lo, _along(self.qs[hi], self.seconds[hi], tokens_per_row), w)


@dataclass(frozen=True)
class CostTable:
    """A measured step-time table of one model on one device, interpolated by the module's rule."""

    name: str            # the source file's name
    description: str     # "<model> on <device_name>"
    device: str
    device_name: str
    model: str
    slices: tuple[LengthSlice, ...]  # the usable lengths, ascending
    lengths: Grid                    # their L, for bisect
    prefill_token_seconds: float     # the marginal per-token time of the prefill rule

    @classmethod
    def load(cls, path: str | Path, model: str | None = None) -> CostTable:
        """Read a table written by bench/verify_cost.py or bench/engine_cost.py (`model`: which, if it has several)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path.name}: not a cost table (invalid JSON: {error})") from error
        return cls.from_json(data, name=path.name, model=model)

    @classmethod
    def from_json(cls, data: Any, name: str = "<table>", model: str | None = None) -> CostTable:
        """Build from the parsed JSON (as `load` does); ValueError naming `name` where nothing usable is in it."""
        if not isinstance(data, dict) or not isinstance(data.get("points"), list):
            raise ValueError(f"{name}: not a cost table (no 'points' list)")
        environment = data.get("environment") or {}
        points = [p for p in data["points"] if isinstance(p, dict) and p.get("status") == "ok"]
        if not points:
            raise ValueError(f"{name}: no usable points (none of its {len(data['points'])} points has status 'ok')")
        model = _pick_model(name, points, environment, data.get("settings") or {}, model)
        points = [p for p in points if p.get("model", model) == model]
        slices = _slices(name, points)
        device_name = str(environment.get("device_name", "unknown device"))
        return cls(name=name, description=f"{model} on {device_name}", device=str(environment.get("device", "")),
                   device_name=device_name, model=model, slices=slices,
                   lengths=tuple(s.length for s in slices), prefill_token_seconds=_prefill_rate(slices[0]))

    def step_seconds(self, rows: int, tokens_per_row: float, context: float) -> float:
        """One decode/verify step's seconds: `rows` running rows verifying `tokens_per_row` tokens each on
        average (1 + drafts; fractional for mixed drafts), mean context `context` tokens (rules a-c)."""
        if rows < 1:
            raise ValueError(f"rows must be at least 1 (got {rows})")
        lo, hi, w = _bracket(self.lengths, context)
        t_lo = self.slices[lo].at(rows, tokens_per_row)
        if w == 0.0:
            return t_lo
        return _mix(t_lo, self.slices[hi].at(rows, tokens_per_row), w)

    def step_seconds_many(self, rows: int, tokens_per_row: npt.ArrayLike, context: float) -> FloatArray:
        """`step_seconds` at many tokens per row at once (the drafting policy weighs every draft length of a
        step): exact at the table's measured q's, which are the knots of the piecewise-linear rule, linear
        between them, and beyond the last extrapolated from the last two (never below the last)."""
        knots = self.q_knots()
        values = np.array([self.step_seconds(rows, q, context) for q in knots])
        qs = np.asarray(tokens_per_row, dtype=np.float64)
        inside: FloatArray = np.interp(qs, knots, values)
        if len(knots) < 2:
            return inside
        slope = (values[-1] - values[-2]) / (knots[-1] - knots[-2])
        beyond = values[-1] + np.maximum(slope, 0.0) * (qs - knots[-1])
        return np.where(qs > knots[-1], beyond, inside)

    def q_knots(self) -> FloatArray:
        """Every q (tokens per row) measured anywhere in the table, ascending: the knots of its curve in q."""
        return self._q_knots

    @functools.cached_property
    def _q_knots(self) -> FloatArray:
        return np.array(sorted({q for s in self.slices for qs in s.qs for q in qs}))

    def prefill_seconds(self, tokens: int, context: float) -> float:
        """Seconds that prefilling `tokens` prompt tokens adds to a step: tokens x the compute-bound per-token
        time (the prefill rule; `context` does not change it)."""
        return max(0, tokens) * self.prefill_token_seconds

    def describe(self) -> dict[str, Any]:
        """Where the table comes from and what it covers, for reports."""
        return {"source": self.name, "device": self.device, "device_name": self.device_name, "model": self.model,
                "lengths": [_plain(s.length) for s in self.slices],
                "batches": {str(_plain(s.length)): [_plain(b) for b in s.batches] for s in self.slices},
                "qs": sorted({_plain(q) for s in self.slices for qs in s.qs for q in qs}),
                "points": sum(len(s.batches) for s in self.slices),
                "prefill_token_us": self.prefill_token_seconds * 1e6}


def _plain(x: float) -> float | int:
    """An integral float as int (JSON and printing)."""
    return int(x) if x.is_integer() else x


def _pick_model(name: str, points: list[dict[str, Any]], environment: dict[str, Any], settings: dict[str, Any],
                model: str | None) -> str:
    """The table's model: the one asked for, else the points' one model, else what the environment or settings say."""
    named = sorted({str(p["model"]) for p in points if "model" in p})
    if model is not None:
        if named and model not in named:
            raise ValueError(f"{name}: no usable points for model {model!r} (it has {named})")
        return model
    if len(named) > 1:
        raise ValueError(f"{name}: points of several models {named}; pass model=")
    if named:
        return named[0]
    declared = environment.get("model", settings.get("model", "unknown model"))
    return ",".join(map(str, declared)) if isinstance(declared, list) else str(declared)


def _slices(name: str, points: list[dict[str, Any]]) -> tuple[LengthSlice, ...]:
    """Group the ok points by length, then batch size (later points of one (L, B) add to or replace q's)."""
    grid: dict[float, dict[float, dict[float, float]]] = {}
    for point in points:
        times = {float(q): float(ms) / 1000.0 for q, ms in (point.get("t_ms") or {}).items()
                 if isinstance(ms, int | float) and math.isfinite(ms)}
        if times:
            grid.setdefault(float(point["L"]), {}).setdefault(float(point["B"]), {}).update(times)
    slices = []
    for length, by_batch in sorted(grid.items()):
        if len(by_batch) < 2:
            continue  # rule b: a length with fewer than 2 measured batch sizes is ignored
        batches = tuple(sorted(by_batch))
        slices.append(LengthSlice(length=length, batches=batches,
                                  qs=tuple(tuple(sorted(by_batch[b])) for b in batches),
                                  seconds=tuple(tuple(by_batch[b][q] for q in sorted(by_batch[b])) for b in batches)))
    if not slices:
        measured = {_plain(length): sorted(_plain(b) for b in by_batch) for length, by_batch in sorted(grid.items())}
        raise ValueError(f"{name}: no usable length (each needs ok points at 2 or more batch sizes; "
                         f"measured batch sizes per length: {measured})")
    return tuple(slices)


def _prefill_rate(first: LengthSlice) -> float:
    """Seconds per prefilled token: the slope between the two largest B*q at the smallest length (the prefill rule)."""
    slowest: dict[float, float] = {}
    for batch, qs, seconds in zip(first.batches, first.qs, first.seconds, strict=True):
        for q, t in zip(qs, seconds, strict=True):
            slowest[batch * q] = max(t, slowest.get(batch * q, t))
    (n_lo, t_lo), (n_hi, t_hi) = sorted(slowest.items())[-2:]
    return max(0.0, (t_hi - t_lo) / (n_hi - n_lo))
