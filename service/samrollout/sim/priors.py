"""Which step-cost prior ours starts from in a projection: the simulator's table, the generic line, a wrong table.

In a projection the simulator's truth is its cost table (``--cost``).  Ours' adaptive policy starts from a
prior shape (`samrollout.spec_decode.step_cost`) and corrects it online from the steps it times:

- ``table``: the simulator's table itself (the prior is the truth; an H100 with its shipped table);
- ``line``: the generic compute-bound line (`LinearShape`), what a device with no table gets (an Ascend NPU,
  a CPU): the headline, since the fit must learn the device;
- ``wrong-table``: the simulator's table with every draft token made `WRONG_DRAFT_FACTOR` x costlier
  (t'(q) = t(1) + 2 (t(q) - t(1)) at every measured point): a table of another device or model;
- ``auto``: the server's default for the device kind (`samrollout.config.resolve_cost_prior`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from samrollout.config import DeviceKind, resolve_cost_prior

COST_PRIORS = ("auto", "table", "line", "wrong-table")
WRONG_DRAFT_FACTOR = 2.0


def draft_costlier(data: dict[str, Any], factor: float = WRONG_DRAFT_FACTOR) -> dict[str, Any]:
    """A cost table's JSON with each point's extra time of the drafts (t(q) - t(1)) times ``factor``."""
    points = []
    for point in data["points"]:
        times = point.get("t_ms") or {}
        if point.get("status") == "ok" and "1" in times:
            base = float(times["1"])
            point = {**point, "t_ms": {q: base + factor * (float(ms) - base) for q, ms in times.items()}}
            point.pop("samples_ms", None)
        points.append(point)
    return {**data, "points": points, "derived": f"draft tokens x{factor:g} costlier than in the source table"}


def prior_path(prior: str, cost_path: str, device_kind: DeviceKind) -> str:
    """The `SpeculationConfig.cost_prior` (``"linear"`` or a table's path) a prior name means in a projection
    on the table at ``cost_path``; ``wrong-table`` is written once under the temporary directory."""
    if prior == "auto":
        return resolve_cost_prior("auto", device_kind)
    if prior == "table":
        return str(Path(cost_path).resolve())
    if prior == "line":
        return "linear"
    if prior == "wrong-table":
        source = Path(cost_path).read_bytes()
        derived = draft_costlier(json.loads(source))
        digest = hashlib.sha256(source).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"samrollout-wrong-table-{digest}.json"
        if not path.exists():  # written aside and renamed: worker processes may ask at once
            aside = path.with_name(f"{path.name}.{os.getpid()}")
            aside.write_text(json.dumps(derived))
            aside.replace(path)
        return str(path)
    raise ValueError(f"unknown cost prior {prior!r}: choose from {', '.join(COST_PRIORS)}")


FIT_EVERY_STEPS = 64   # engine steps (over all instances) between two samples of ours' step-cost fit
FIT_QS = (1.0, 2.0, 4.0, 8.0, 16.0)  # tokens per row at which the fit's prediction is held against the truth


def fit_sample(drafter: object, truth: Any, rows: int, context: float, clock: float) -> dict[str, Any] | None:
    """Where ours' online step-cost fit stands (None: the drafter has none, the static mode or a peer): its
    (u, w, v, observations) at this batch size, and its mean relative error against the simulator's table
    over `FIT_QS` tokens per row at this batch size and context: 0 when the fit has learned the device."""
    cost = getattr(getattr(getattr(drafter, "session", None), "goodput", None), "cost", None)
    if cost is None or rows < 1:
        return None
    qs = np.array(FIT_QS)
    predicted = cost.seconds(rows, rows * qs, context)
    true = np.array([truth.step_seconds(rows, float(q), context) for q in qs])
    u, w, v = cost.correction(rows)
    return {"t": round(clock, 3), "rows": rows, "context": round(context), "u": u, "w": w, "v": v,
            "relative_error": float(np.mean(np.abs(predicted - true) / true))}


def fit_summary(samples: list[dict[str, Any]], most: int = 24) -> dict[str, Any]:
    """A run's fit samples for the report: the first and last quarter's mean relative error and at most
    ``most`` samples spread over the run."""
    if not samples:
        return {}
    quarter = max(1, len(samples) // 4)
    stride = max(1, len(samples) // most)
    return {"first_quarter_error": float(np.mean([s["relative_error"] for s in samples[:quarter]])),
            "last_quarter_error": float(np.mean([s["relative_error"] for s in samples[-quarter:]])),
            "samples": samples[::stride][:most] + ([samples[-1]] if len(samples) > most else [])}
