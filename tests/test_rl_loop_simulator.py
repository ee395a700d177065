"""The RL-loop simulator: trainer steps over epochs on several instances, per-instance history, update costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from samrollout.config import SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.replay.drafters import SamReplayDrafter
from samrollout.replay.traces import TraceGroup
from samrollout.sim.rl_loop import LoopSettings, UpdateCosts, epoch_stream, simulate_loop
from samrollout.sim.state import SimSettings
from support.cost_tables import STEP_MS, flat_table

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
FREE = UpdateCosts(checkpoint_bytes=0.0)  # updates that cost nothing


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def _prompts(count: int, responses: list[int], repeat_epochs: bool = False) -> list[TraceGroup]:
    """``count`` prompts with responses of these lengths; ``repeat_epochs``: its second half repeats the first
    (so a later epoch's responses are exactly the earlier ones: drafting from history accepts everything)."""
    groups = []
    for p in range(count):
        half = [_tokens(n, 1000 * p + i) for i, n in enumerate(responses)]
        groups.append(TraceGroup(f"p{p}", _tokens(8, p), [*half, *[r.copy() for r in half]] if repeat_epochs
                                 else half))
    return groups


def _ours() -> Any:
    config = SpeculationConfig(k=3, threshold_mode="off", history_tokens=1 << 20, group_drafting=True,
                               policy=DraftPolicy(min_match_length=1))
    return lambda: SamReplayDrafter.as_engine("sam", VOCAB, config)


def _loop(loop: str, steps: int, batch: int, **kwargs: Any) -> LoopSettings:
    return LoopSettings(loop=loop, steps=steps, batch_groups=batch, updates=kwargs.pop("updates", FREE),
                        **kwargs)  # type: ignore[arg-type]


def test_epochs_split_each_prompts_responses_so_no_response_is_replayed_twice() -> None:
    groups = _prompts(3, [10, 20, 30, 40, 50])
    stream = epoch_stream(groups, 2, shuffle_seed=None)
    assert [(g.prompt_index, g.epoch) for g in stream] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    shuffled = epoch_stream(groups, 2)
    assert sorted(g.prompt_index for g in shuffled[3:]) == [0, 1, 2]  # every prompt once in its epoch
    for p in range(3):
        used = [len(r) for g in stream if g.prompt_index == p for r in g.responses]
        assert sorted(used) == [10, 20, 30, 40, 50]  # each response in exactly one epoch, in recorded order
    assert [len(r) for r in stream[0].responses] == [10, 20, 30]


def test_a_sync_step_waits_for_its_longest_response_then_trains_and_updates() -> None:
    stream = epoch_stream(_prompts(4, [30, 100]), 1)
    updates = UpdateCosts(checkpoint_bytes=4e9, transfer="shared-disk", disk_gbyte_s=2.0)  # 2 s pause
    result = simulate_loop(stream, None, 1, flat_table(), SimSettings(slots=64, charge_drafter=False),
                           _loop("sync-wait", 2, 2, train_s=5.0, updates=updates))
    step = 100 * STEP_MS / 1e3  # each step's makespan: its longest response, one token a step
    assert result.step_rollout_s == pytest.approx([step, step])
    assert result.wall_s == pytest.approx(2 * (step + 5.0 + 2.0))
    assert result.samples == 8 and result.samples_per_s == pytest.approx(8 / result.wall_s)
    assert result.update_s == pytest.approx(4.0) and result.recomputed_tokens == 0
    assert dict(result.staleness) == {0: 8}


def test_a_push_costs_the_checkpoint_once_per_server_and_a_fan_out_once() -> None:
    push = UpdateCosts(checkpoint_bytes=16e9, transfer="push", link_gbit_s=25.0)
    fanout = UpdateCosts(checkpoint_bytes=16e9, transfer="push-fanout", link_gbit_s=25.0)
    assert push.transfer_s(8) == pytest.approx(8 * 16e9 * 8 / 25e9)
    assert fanout.transfer_s(8) == pytest.approx(16e9 * 8 / 25e9)
    assert UpdateCosts(transfer="shared-disk").transfer_s(8) == 0.0


def test_async_partial_rollouts_hand_over_only_samples_within_the_staleness_bound() -> None:
    stream = epoch_stream(_prompts(24, [20, 40, 400]), 1)
    for bound in (0, 1, 2):
        result = simulate_loop(stream, None, 1, flat_table(), SimSettings(slots=16, charge_drafter=False),
                               _loop("async-continue", 6, 3, max_staleness=bound, train_s=0.5))
        assert result.samples == 6 * 3 * 3
        assert max(result.staleness) <= bound
    unbounded = simulate_loop(stream, None, 1, flat_table(), SimSettings(slots=16, charge_drafter=False),
                              _loop("async-continue", 6, 3, max_staleness=None, train_s=0.5))
    assert max(unbounded.staleness) > 0 and unbounded.restarted_samples == 0


def test_continue_updates_recompute_the_kv_in_flight_unless_it_is_kept() -> None:
    # Groups of mixed lengths: when a batch is complete, longer groups are still generating.
    stream = epoch_stream([TraceGroup(f"p{p}", _tokens(8, p), [_tokens(50, p), _tokens(60 * (1 + p % 5), 99 + p)])
                           for p in range(12)], 1)
    settings = SimSettings(slots=16, charge_drafter=False)
    recompute = simulate_loop(stream, None, 1, flat_table(), settings,
                              _loop("async-continue", 4, 2, max_staleness=None, updates=UpdateCosts(
                                  checkpoint_bytes=0.0, kv="recompute")))
    keep = simulate_loop(stream, None, 1, flat_table(), settings,
                         _loop("async-continue", 4, 2, max_staleness=None, updates=UpdateCosts(
                             checkpoint_bytes=0.0, kv="keep")))
    assert recompute.recomputed_tokens > 0 and keep.recomputed_tokens == 0


def test_async_keeps_the_engine_busy_where_sync_waits_for_the_tail() -> None:
    stream = epoch_stream(_prompts(40, [20, 20, 20, 600]), 1)
    settings = SimSettings(slots=64, charge_drafter=False)
    sync = simulate_loop(stream, None, 1, flat_table(), settings, _loop("sync-wait", 6, 5))
    partial = simulate_loop(stream, None, 1, flat_table(), settings, _loop("async-continue", 6, 5,
                                                                            max_staleness=None))
    assert partial.samples_per_s > 1.3 * sync.samples_per_s


def test_affine_placement_brings_a_prompt_back_to_the_instance_that_holds_its_history() -> None:
    stream = epoch_stream(_prompts(8, [60, 60], repeat_epochs=True), 2)  # epoch 1 repeats epoch 0 exactly
    settings = SimSettings(slots=64, instances=2, charge_drafter=False)
    affine = simulate_loop(stream, _ours(), 3, flat_table(), settings, _loop("sync-wait", 2, 8, placement="affine"))
    spread = simulate_loop(stream, _ours(), 3, flat_table(), settings,
                           _loop("sync-wait", 2, 8, placement="least-outstanding"))
    assert affine.history_groups == spread.history_groups == 8
    assert affine.history_hits == 8 and spread.history_hits < 8
    # The second epoch drafts its (identical) earlier responses only where they ran: affine's is faster.
    assert affine.step_rollout_s[1] < spread.step_rollout_s[1]
    assert affine.step_rollout_s[0] == pytest.approx(spread.step_rollout_s[0], rel=0.05)


def test_a_partial_rollout_under_affine_placement_brings_every_prompt_back_to_its_history() -> None:
    # The load bound counts each request in flight once: asynchronous steps keep two batches in flight on
    # two instances, well within the bound, so every prompt of the second epoch returns to its instance.
    # (Counting a group's requests once per sibling, 6 of these 31 were pushed off.)
    stream = epoch_stream(_prompts(32, [60, 60], repeat_epochs=True), 2)
    settings = SimSettings(slots=64, instances=2, charge_drafter=False)
    result = simulate_loop(stream, _ours(), 3, flat_table(), settings,
                           _loop("async-continue", 7, 8, placement="affine", max_staleness=None))
    assert result.history_groups >= 24
    assert result.history_hits == result.history_groups


def _global_memory(kind: str) -> Any:
    """Drafters that keep every finished response, of any prompt: ours with its global index, vLLM `suffix`."""
    if kind == "ours-global":
        config = SpeculationConfig(max_draft=8, history_tokens=1 << 20, policy=DraftPolicy(max_global_tokens=1 << 20))
        return lambda: SamReplayDrafter.as_engine("sam", VOCAB, config)
    from samrollout.replay.registry import make_drafter

    return lambda: make_drafter("suffix-cache", VOCAB)


@pytest.mark.parametrize("drafter", ["ours", "ours-global", "suffix-cache"])
def test_a_response_is_never_its_own_history(drafter: str) -> None:
    # One epoch of random responses: nothing earlier to draft from, so drafts almost never land, however many
    # steps and restarts.  A restarted sample replays its recorded tokens only as a stand-in for a new response
    # of that length, so it drafts nothing: its first run is in every drafter that keeps finished responses.
    stream = epoch_stream(_prompts(16, [200, 200]), 1)
    factory = _ours() if drafter == "ours" else _global_memory(drafter)
    result = simulate_loop(stream, factory, 8, flat_table(), SimSettings(slots=8, charge_drafter=False),
                           _loop("async-continue", 6, 2, max_staleness=0, train_s=0.3))
    assert result.restarted_samples > 0
    assert result.accepted / max(1, result.drafted) < 0.1


def test_simulate_rl_command_writes_every_loop_and_drafter_per_projection(tmp_path: Path) -> None:
    out = tmp_path / "rl.json"
    cmd = [sys.executable, "-m", "samrollout.cli", "simulate-rl", "--traces",
           "bench/data/smollm2-math-groups.jsonl.gz", "--cost", "bench/results/verify-cost-h100.json",
           "--responses", "all", "--max-groups", "6", "--epochs", "2", "--instances", "2", "--slots", "16",
           "--batch-groups", "2", "--train-ratio", "0,0.5", "--max-staleness", "1", "--placements",
           "affine,least-outstanding", "--weights", "push", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    projections = report["projections"]
    assert [(p["placement"], p["train_ratio"]) for p in projections] == [
        ("affine", 0.0), ("affine", 0.5), ("least-outstanding", 0.0), ("least-outstanding", 0.5)]
    for projection in projections:
        assert set(projection["modes"]) == {f"{loop}-{drafter}" for loop in ("sync", "async")
                                            for drafter in ("off", "suffix", "samrollout")}
        assert all(mode["samples_per_s"] > 0 and mode["tokens_per_s"] > 0 and mode["steady"]["tokens_per_s"] > 0
                   for mode in projection["modes"].values())
        # Simulated slowest first, side by side: each report still lands under its own mode.
        assert all((mode["drafted"] == 0) == name.endswith("-off") for name, mode in projection["modes"].items())
        assert projection["weights"] == "push" and projection["staleness"] == 1
    # One trainer: the training time comes from sync + off on the first placement, for every placement.
    assert projections[1]["train_s"] == pytest.approx(0.5 * projections[1]["sync_off_rollout_s"])
    assert projections[3]["train_s"] == projections[1]["train_s"]
    assert "tok/s" in proc.stdout and "steady" in proc.stdout
