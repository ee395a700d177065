"""CostTable: loading cost tables and interpolating step times between and beyond the measured points."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from samrollout.sim.cost import CostTable

H100 = Path(__file__).resolve().parents[1] / "bench" / "results" / "verify-cost-h100.json"


def point(length: int, batch: int, t_ms: dict[int, float], status: str = "ok") -> dict[str, Any]:
    return {"L": length, "B": batch, "t_ms": {str(q): ms for q, ms in t_ms.items()}, "status": status}


def table(points: list[dict[str, Any]]) -> CostTable:
    data = {"environment": {"device": "cpu", "device_name": "test cpu", "model": "tiny"}, "settings": {},
            "points": points}
    return CostTable.from_json(data, name="synthetic.json")


# Two lengths; at L=100: B in {1, 4}, q in {1, 3}; at L=300: B in {1, 4} with the same q's, all times +30 ms.
GRID = [
    point(100, 1, {1: 10.0, 3: 14.0}),
    point(100, 4, {1: 16.0, 3: 28.0}),
    point(300, 1, {1: 40.0, 3: 44.0}),
    point(300, 4, {1: 46.0, 3: 58.0}),
]


def ms(table_: CostTable, rows: int, q: float, context: float) -> float:
    return table_.step_seconds(rows, q, context) * 1e3


def test_step_time_at_a_measured_point_is_the_measurement() -> None:
    t = table(GRID)
    for p in GRID:
        for q, value in p["t_ms"].items():
            assert ms(t, p["B"], int(q), p["L"]) == pytest.approx(value, rel=1e-12)


def test_step_time_between_measured_qs_is_linear() -> None:
    assert ms(table(GRID), 1, 2.0, 100) == pytest.approx(12.0)
    assert ms(table(GRID), 4, 1.5, 100) == pytest.approx(19.0)


def test_step_time_between_measured_batches_is_linear() -> None:
    assert ms(table(GRID), 2, 1, 100) == pytest.approx(12.0)  # 1/3 of the way from B=1 to B=4
    assert ms(table(GRID), 3, 3, 100) == pytest.approx(14.0 + 2 / 3 * 14.0)


def test_step_time_between_measured_lengths_is_linear() -> None:
    assert ms(table(GRID), 1, 1, 200) == pytest.approx(25.0)
    assert ms(table(GRID), 4, 3, 250) == pytest.approx(28.0 + 0.75 * 30.0)


def test_step_time_interpolates_q_then_batch_then_length() -> None:
    # q=2, B=2, L=200: at L=100, 12 (B=1) and 22 (B=4) -> 12 + 10/3; at L=300 the same +30; halfway between.
    assert ms(table(GRID), 2, 2.0, 200) == pytest.approx(12.0 + 10 / 3 + 15.0)


def test_step_time_beyond_the_largest_q_extrapolates_from_the_last_two_qs() -> None:
    assert ms(table(GRID), 1, 5, 100) == pytest.approx(18.0)
    assert ms(table(GRID), 4, 9, 100) == pytest.approx(16.0 + 8 * 6.0)


def test_step_time_beyond_the_largest_batch_extrapolates_from_the_last_two_batches() -> None:
    assert ms(table(GRID), 10, 1, 100) == pytest.approx(10.0 + 9 * 2.0)


def test_step_time_beyond_the_largest_length_extrapolates_from_the_last_two_lengths() -> None:
    assert ms(table(GRID), 1, 1, 500) == pytest.approx(70.0)


def test_step_time_below_the_measured_grid_is_clamped() -> None:
    t = table(GRID)
    assert ms(t, 1, 0.5, 100) == pytest.approx(10.0)   # q below 1
    assert ms(t, 1, 1, 10) == pytest.approx(10.0)      # L below the smallest length
    assert ms(t, 1, 0.0, 0.0) == pytest.approx(10.0)


def test_batch_below_the_smallest_measured_batch_is_clamped() -> None:
    t = table([point(100, 2, {1: 10.0}), point(100, 4, {1: 12.0})])
    assert ms(t, 1, 1, 100) == pytest.approx(10.0)


def test_extrapolation_never_goes_below_the_last_measured_value() -> None:
    t = table([point(100, 1, {1: 10.0, 2: 12.0, 3: 11.0}), point(100, 4, {1: 16.0, 2: 20.0, 3: 19.0})])
    assert ms(t, 1, 9, 100) == pytest.approx(11.0)   # the last two q's slope down: flat from q=3
    assert ms(t, 1, 2.5, 100) == pytest.approx(11.5)  # between measured q's it still follows them


def test_batch_extrapolation_uses_the_batches_measured_at_that_length() -> None:
    points = [point(100, 1, {1: 10.0}), point(100, 2, {1: 11.0}), point(100, 8, {1: 20.0}),
              point(200, 1, {1: 20.0}), point(200, 2, {1: 22.0})]
    t = table(points)
    # At L=200 B=8 is not measured: extrapolate from B=1, 2 there (20 + 7 * 2 = 34).
    assert ms(t, 8, 1, 200) == pytest.approx(34.0)
    assert ms(t, 8, 1, 150) == pytest.approx((20.0 + 34.0) / 2)


def test_a_length_with_one_measured_batch_is_ignored() -> None:
    t = table([*GRID, point(1000, 1, {1: 999.0})])
    assert t.lengths == (100.0, 300.0)
    assert ms(t, 1, 1, 1000) == pytest.approx(10.0 + 900 * 0.15)


def test_skipped_points_do_not_count() -> None:
    t = table([*GRID, {"L": 300, "B": 8, "status": "skipped: OOM"}, point(300, 16, {1: 1.0}, status="skipped: budget")])
    assert t.slices[1].batches == (1.0, 4.0)


def test_prefill_rate_is_the_slope_between_the_two_largest_batch_times_q_at_the_smallest_length() -> None:
    # At L=100 the largest B*q are 12 (28 ms) and 4 (16 ms at B=4 q=1; 14 ms at B=1 q=3 is 3): slope 12/8 ms.
    t = table(GRID)
    assert t.prefill_token_seconds == pytest.approx(1.5e-3)
    assert t.prefill_seconds(100, context=5000) == pytest.approx(0.15)
    assert t.prefill_seconds(0, context=0) == 0.0


def test_a_file_with_no_ok_points_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"environment": {}, "settings": {}, "points": [
        {"L": 128, "B": 1, "status": "skipped: OOM"}]}))
    with pytest.raises(ValueError, match=r"empty\.json: no usable points"):
        CostTable.load(path)


def test_a_file_whose_lengths_have_one_batch_each_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no usable length"):
        table([point(100, 1, {1: 10.0}), point(200, 4, {1: 12.0})])


def test_a_file_that_is_no_cost_table_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="not a cost table"):
        CostTable.load(path)


def test_zero_rows_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="rows"):
        table(GRID).step_seconds(0, 1, 100)


def test_the_shipped_h100_table_gives_its_measured_step_time() -> None:
    t = CostTable.load(H100)
    assert t.step_seconds(1, 1, 1024) == pytest.approx(10.207183837890625e-3, rel=1e-12)
    assert t.model == "qwen3-8b" and t.device_name == "NVIDIA H100 80GB HBM3"
    assert t.step_seconds(64, 9, 1024) == pytest.approx(28.17308807373047e-3, rel=1e-12)
    # B=64 at L=8192 was skipped (OOM): the step time there extrapolates from B=16, 32 at that length.
    b16, b32 = 17.610767364501953e-3, 26.365344047546387e-3
    assert t.step_seconds(64, 1, 8192) == pytest.approx(b32 + 2 * (b32 - b16))


def test_step_time_grows_with_rows_and_tokens_on_the_h100_table() -> None:
    t = CostTable.load(H100)
    assert t.step_seconds(8, 1, 4096) < t.step_seconds(32, 1, 4096) < t.step_seconds(32, 5, 4096)
    assert t.step_seconds(16, 2.5, 2000) < t.step_seconds(16, 2.5, 6000)


def test_describe_names_the_source_and_the_grid() -> None:
    info = CostTable.load(H100).describe()
    assert info["source"] == "verify-cost-h100.json" and info["model"] == "qwen3-8b"
    assert info["lengths"] == [1024, 8192] and info["qs"] == [1, 2, 3, 4, 5, 9]
    assert info["batches"]["8192"] == [1, 2, 4, 8, 16, 32]


def test_a_step_time_takes_microseconds() -> None:
    t = CostTable.load(H100)
    calls = 20_000
    start = time.perf_counter()
    for i in range(calls):
        t.step_seconds(1 + i % 100, 1 + (i % 7) / 2, 500 + i % 9000)
    assert (time.perf_counter() - start) / calls < 50e-6  # ~3 us here; the simulator calls it per step
