"""Cost tables for simulator tests: every step takes the same time, so expected makespans are step counts."""

from __future__ import annotations

from samrollout.sim.cost import CostTable

STEP_MS = 10.0


def flat_table(step_ms: float = STEP_MS) -> CostTable:
    """Every step takes ``step_ms`` whatever its rows, tokens per row and context (and prefill adds nothing)."""
    points = [{"L": length, "B": batch, "status": "ok", "t_ms": {str(q): step_ms for q in (1, 2, 4, 9)}}
              for length in (128, 1024) for batch in (1, 8, 64)]
    return CostTable.from_json({"environment": {"device": "cpu", "device_name": "test"}, "points": points},
                               model="test")
