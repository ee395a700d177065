"""The rollout simulator: step times from a cost table, drafts from the engine's own session, slots, KV, scheduling."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from samrollout.config import SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.replay.drafters import SamReplayDrafter
from samrollout.replay.simulate import replay
from samrollout.replay.traces import TraceGroup
from samrollout.sim.cost import CostTable
from samrollout.sim.rollout import SimSettings, simulate
from support.cost_tables import STEP_MS, flat_table

VOCAB = 64


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def _group(key: str, lengths: list[int], seed: int) -> TraceGroup:
    return TraceGroup(key, _tokens(8, seed), [_tokens(n, seed * 100 + i) for i, n in enumerate(lengths)])


def _ours(threshold_mode: str = "off", k: int = 3) -> Any:
    config = SpeculationConfig(k=k, threshold_mode=threshold_mode, history_tokens=0,
                               policy=DraftPolicy(min_match_length=1))
    return lambda: SamReplayDrafter.as_engine("sam", VOCAB, config)


def test_without_speculation_the_makespan_is_the_longest_response_times_the_step_time() -> None:
    groups = [_group("a", [30, 50], 1), _group("b", [20], 2)]
    result = simulate(groups, None, 1, flat_table(), SimSettings(slots=8, charge_drafter=False), "off")
    assert result.steps == 50  # the first token comes from the prefill step
    assert result.makespan_s == pytest.approx(50 * STEP_MS / 1e3)
    assert result.tokens == 100 and result.mean_acceptance_length == 1.0


def test_with_one_slot_responses_run_one_after_another() -> None:
    groups = [_group("a", [30, 50], 1), _group("b", [20], 2)]
    result = simulate(groups, None, 1, flat_table(), SimSettings(slots=1, charge_drafter=False), "off")
    assert result.steps == 100
    assert result.makespan_s == pytest.approx(100 * STEP_MS / 1e3)


def test_a_looping_response_finishes_in_fewer_steps_with_sam_drafts() -> None:
    loop = np.tile(_tokens(12, 3), 20)
    groups = [TraceGroup("loop", _tokens(8, 4), [loop])]
    off = simulate(groups, None, 1, flat_table(), SimSettings(charge_drafter=False), "off")
    ours = simulate(groups, _ours(), 3, flat_table(), SimSettings(charge_drafter=False), "sam")
    assert ours.tokens == off.tokens == len(loop)
    assert ours.steps < off.steps / 2 and ours.mean_acceptance_length > 2.5
    assert ours.makespan_s < off.makespan_s / 2


def test_the_simulators_acceptance_equals_the_replays_when_every_response_runs_at_once() -> None:
    groups = [TraceGroup(f"g{g}", _tokens(8, g), [np.tile(_tokens(7, 10 * g + i), 9 + i) for i in range(3)])
              for g in range(3)]
    simulated = simulate(groups, _ours(), 3, flat_table(), SimSettings(slots=64, charge_drafter=False), "sam")
    replayed = replay(_ours()(), groups, k=3, threshold=None)
    assert simulated.accepted == replayed.accepted > 0
    assert simulated.drafted == replayed.drafted


def test_a_kv_budget_too_small_preempts_and_every_response_still_finishes_whole() -> None:
    groups = [_group("a", [60, 60, 60, 60], 5)]
    result = simulate(groups, None, 1, flat_table(), SimSettings(slots=4, kv_tokens=150, charge_drafter=False), "off")
    assert result.preemptions > 0
    assert result.tokens == 240
    assert result.steps > 60  # they could not all run together


def test_length_aware_admission_starts_the_long_group_before_the_short_ones() -> None:
    # Trace order puts three short groups first; length-aware probes each group, then runs the long one.
    groups = [_group(f"s{i}", [10] * 6, i) for i in range(3)] + [_group("long", [200, 200, 200], 9)]
    fcfs = simulate(groups, None, 1, flat_table(), SimSettings(slots=4, charge_drafter=False), "off")
    aware = simulate(groups, None, 1, flat_table(), SimSettings(slots=4, scheduling="length-aware",
                                                                charge_drafter=False), "off")
    assert aware.tokens == fcfs.tokens
    assert fcfs.steps == 250  # 18 short responses on 4 slots (50 steps), then the long ones (200)
    assert aware.steps == 230  # the long group's probe runs from step 10 and its siblings follow it


def test_the_static_threshold_drafts_only_once_few_responses_run() -> None:
    loops = [np.tile(_tokens(10, 20 + i), 6 + 4 * i) for i in range(12)]
    groups = [TraceGroup("g", _tokens(8, 7), loops)]
    always = simulate(groups, _ours("off"), 3, flat_table(), SimSettings(charge_drafter=False), "always")
    static = simulate(groups, _ours("static"), 3, flat_table(), SimSettings(charge_drafter=False), "static")
    assert 0 < static.drafted < always.drafted


def test_critical_path_drafts_shorten_the_longest_response_while_the_batch_is_past_the_threshold() -> None:
    # 12 random responses keep the batch past the threshold of 4 for 200 steps; the looping one runs 3,600 tokens.
    # Past the threshold only confident drafts (k = 3) run, so the loop pulls ahead of the others: then it is the
    # row that has run longest, and critical-path drafting gives it 12.
    groups = [TraceGroup("long", _tokens(8, 40), [np.tile(_tokens(9, 41), 400)]),
              TraceGroup("random", _tokens(8, 42), [_tokens(200, 30 + i) for i in range(12)])]
    def ours(rows: int) -> Any:
        config = SpeculationConfig(k=3, threshold=4, confident_match=8, history_tokens=0, critical_rows=rows,
                                   critical_k=12, policy=DraftPolicy(min_match_length=1))
        return lambda: SamReplayDrafter.as_engine("sam", VOCAB, config)

    settings = SimSettings(slots=16, charge_drafter=False)
    plain = simulate(groups, ours(0), 3, flat_table(), settings, "sam")
    critical = simulate(groups, ours(1), 12, flat_table(), settings, "sam-critical")
    assert plain.critical["length"] == critical.critical["length"] == 3600  # the loop is the critical path
    assert critical.critical["tokens_per_step"] > 2 * plain.critical["tokens_per_step"]
    assert critical.makespan_s < 0.5 * plain.makespan_s


def test_divided_rollout_moves_long_responses_to_an_idle_instance_as_the_client_does() -> None:
    # Groups go whole to an instance: the long group's four responses queue for two slots on one
    # instance while the other finishes its short group and idles.
    groups = [_group("long", [300] * 4, 1), _group("short", [10] * 4, 2)]
    settings = SimSettings(slots=2, instances=2, charge_drafter=False)
    whole = simulate(groups, None, 1, flat_table(), settings, "off")
    divided = simulate(groups, None, 1, flat_table(), replace(settings, divide_after_tokens=50), "off+divided")
    assert whole.moves == 0 and divided.moves > 0
    assert divided.tokens == whole.tokens == 1240  # every response whole, wherever its pieces ran
    assert whole.makespan_s == pytest.approx(600 * STEP_MS / 1e3)  # two waves of 300 steps on one instance
    assert divided.makespan_s < 0.8 * whole.makespan_s


def test_simulate_command_writes_a_projection_per_setting(tmp_path: Path) -> None:
    out = tmp_path / "projection.json"
    plot = tmp_path / "projection.png"
    cmd = [sys.executable, "-m", "samrollout.cli", "simulate", "--traces", "bench/data/smollm2-math-groups.jsonl.gz",
           "--cost", "bench/results/verify-cost-h100.json",
           "--modes", "off,ngram,samrollout,samrollout+fcfs,samrollout-static",
           "--slots", "8,16", "--max-groups", "3", "--responses", "all", "--json", str(out), "--plot", str(plot)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [p["slots"] for p in report["projections"]] == [8, 16]
    for projection in report["projections"]:
        assert set(projection["modes"]) == {"off", "ngram", "samrollout", "samrollout+fcfs", "samrollout-static"}
        assert all(mode["makespan_s"] > 0 for mode in projection["modes"].values())
        ours = projection["modes"]["samrollout"]  # the server's CUDA defaults: the adaptive policy, the H100 prior
        assert ours["config"]["threshold_mode"] == "adaptive" and ours["config"]["cost_prior"].endswith(".json")
        previous = projection["modes"]["samrollout-static"]["config"]  # the CUDA defaults before it
        assert previous["threshold_mode"] == "static" and previous["critical_rows"] == 8
        assert ours["scheduling"] == "length-aware" and projection["modes"]["samrollout+fcfs"]["scheduling"] == "fcfs"
        assert ours["critical"]["length"] > 0
    assert report["device_kind"] == "cuda" and plot.stat().st_size > 0
    assert "makespan s" in proc.stdout


def test_simulate_command_refuses_an_unknown_mode() -> None:
    cmd = [sys.executable, "-m", "samrollout.cli", "simulate", "--traces", "bench/data/smollm2-math-groups.jsonl.gz",
           "--cost", "bench/results/verify-cost-h100.json", "--modes", "off,warp-drive"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2 and "unknown mode 'warp-drive'" in proc.stderr


def test_each_simulated_step_is_timed_before_the_drafter_sees_it_as_in_vllm() -> None:
    # The proposer learns the step cost from the time between its calls, paired with the drafts verified in
    # between: with the simulator's own table as its prior, a correctly paired clock leaves the fit on the table.
    table = "bench/results/verify-cost-h100-k24.json"
    config = SpeculationConfig(max_draft=16, cost_prior=table, history_tokens=0, policy=DraftPolicy(min_match_length=1))
    drafters: list[SamReplayDrafter] = []

    def factory() -> SamReplayDrafter:
        drafters.append(SamReplayDrafter.as_engine("sam", VOCAB, config))
        return drafters[-1]

    def response(seed: int) -> np.ndarray:  # stretches of new text between loops: drafts of every length land
        return np.concatenate([np.concatenate([_tokens(40, seed * 10 + j), np.tile(_tokens(6, seed + j), 12)])
                               for j in range(8)])
    loops = [TraceGroup(f"g{g}", _tokens(8, g), [response(10 * g + i) for i in range(4)]) for g in range(12)]
    simulate(loops, factory, 16, CostTable.load(table), SimSettings(slots=64, charge_drafter=False), "sam")
    cost = drafters[0].session.goodput.cost  # type: ignore[union-attr]
    fits = cost.describe()
    assert sum(fit[3] for fit in fits.values()) > 100
    for u, w, v, _ in fits.values():
        assert (u, w, v) == (pytest.approx(1.0, abs=0.02), pytest.approx(0.0, abs=0.02), pytest.approx(1.0, abs=0.05))
