"""Issue 58's fair comparison: vLLM `suffix` at any setting a user picks (and at its best), and ours' step-cost
prior as a device without a table has it (the line) or a wrong table, its online fit learning the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from samrollout.replay.peers import SuffixSettings, suffix_unavailable_reason
from samrollout.replay.traces import TraceGroup
from samrollout.sim import suffix_best
from samrollout.sim.command import drafter_factory, mode_settings, project
from samrollout.sim.cost import CostTable
from samrollout.sim.priors import draft_costlier, prior_path
from samrollout.sim.rl_command import _ordered
from samrollout.sim.rollout import SimSettings, simulate

ROOT = Path(__file__).parent.parent
H100 = ROOT / "bench" / "results" / "verify-cost-h100-k24.json"
VOCAB = 64
needs_suffix = pytest.mark.skipif(suffix_unavailable_reason() is not None, reason=str(suffix_unavailable_reason()))


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def _looping_groups() -> list[TraceGroup]:
    """Responses that fall into a 40-token loop: a suffix drafter's matches there grow past 24 tokens."""
    return [TraceGroup(f"g{i}", _tokens(8, i), [np.concatenate([_tokens(30, 100 + i), np.tile(_tokens(40, i), 12)])])
            for i in range(2)]


def _run(groups: list[TraceGroup], mode: str, suffix: SuffixSettings | None = None, prior: str = "auto",
         table: CostTable | None = None) -> dict:
    kind, k, config, scheduling = mode_settings(mode, "cuda", suffix, prior, str(H100))
    cost = table or CostTable.load(H100)
    result = simulate(groups, drafter_factory(kind, VOCAB, config, "cuda"), k, cost,
                      SimSettings(slots=16, charge_drafter=False, scheduling=scheduling), mode)
    return {**result.as_dict(), "config": config}


def test_a_bare_suffix_mode_is_vllms_defaults_and_its_name_sets_depth_k_and_spec_factor() -> None:
    kind, k, config, _ = mode_settings("suffix", "cuda")
    assert (kind, k) == ("suffix", 24) and config == SuffixSettings(24, None, 1.0, 0.1, 10_000)
    _, k, config, _ = mode_settings("suffix-d64-k16-f2-n100000", "cuda")
    assert k == 16 and isinstance(config, SuffixSettings)
    assert (config.depth, config.spec_factor, config.cached_requests) == (64, 2.0, 100_000)
    _, k, _, _ = mode_settings("suffix-d64", "cuda")  # vLLM: k defaults to the depth
    assert k == 64
    _, k, config, _ = mode_settings("suffix", "cuda", SuffixSettings(depth=64, k=32))  # the --suffix-* options
    assert k == 32 and isinstance(config, SuffixSettings) and config.depth == 64


@needs_suffix
def test_suffix_at_depth_64_drafts_longer_than_at_vllms_default_depth_on_a_looping_response() -> None:
    groups = _looping_groups()
    default = _run(groups, "suffix")
    deeper = _run(groups, "suffix", SuffixSettings(depth=64, k=32, spec_factor=2.0))
    assert deeper["mean_acceptance_length"] > default["mean_acceptance_length"] + 1
    assert deeper["steps"] < default["steps"]


@needs_suffix
def test_simulate_takes_the_suffix_options_on_its_command_line(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "samrollout.cli", "simulate", "--traces", "bench/data/smollm2-math-groups.jsonl.gz",
           "--cost", str(H100), "--modes", "suffix", "--max-groups", "1", "--responses", "all", "--suffix-depth", "64",
           "--suffix-k", "32", "--suffix-spec-factor", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mode = json.loads(out.read_text())["projections"][0]["modes"]["suffix"]
    assert mode["k"] == 32 and mode["config"]["suffix_decoding_max_tree_depth"] == 64
    assert mode["config"]["suffix_decoding_max_spec_factor"] == 2.0


@needs_suffix
def test_suffix_best_is_the_fastest_point_of_the_grid_and_names_its_setting() -> None:
    groups = _looping_groups()[:1]
    plans = {m: mode_settings(m, "cuda") for m in suffix_best.expand(["suffix", "suffix-best"])}
    assert len(plans) == 1 + 12
    projection = project("loops", "all", groups, [], SimSettings(slots=4, charge_drafter=False), plans, VOCAB,
                         CostTable.load(H100), "cuda", bests=["suffix-best"])
    modes = projection["modes"]
    winner = modes["suffix-best"]["setting"]
    assert winner in suffix_best.grid_modes() and modes["suffix-best"]["makespan_s"] == modes[winner]["makespan_s"]
    assert modes["suffix-best"]["makespan_s"] == min(modes[m]["makespan_s"] for m in suffix_best.grid_modes())
    assert modes["suffix-best"]["makespan_s"] < modes["suffix"]["makespan_s"]


def test_the_wrong_table_makes_every_draft_token_twice_as_costly() -> None:
    data = json.loads(H100.read_text())
    wrong = draft_costlier(data)
    for before, after in zip(data["points"], wrong["points"], strict=True):
        if before.get("status") == "ok":
            t1 = before["t_ms"]["1"]
            for q, ms in before["t_ms"].items():
                assert after["t_ms"][q] == pytest.approx(t1 + 2 * (ms - t1))
    wrong_seconds = CostTable.from_json(wrong, "wrong").step_seconds(32, 9, 4096)
    assert wrong_seconds > CostTable.load(H100).step_seconds(32, 9, 4096)


def test_the_priors_name_the_table_the_line_and_a_wrong_table() -> None:
    assert prior_path("line", str(H100), "cuda") == "linear"
    assert prior_path("table", str(H100), "cuda") == str(H100.resolve())
    assert json.loads(Path(prior_path("wrong-table", str(H100), "cuda")).read_text())["derived"].startswith("draft")
    _, _, config, _ = mode_settings("samrollout@line", "cuda", cost_path=str(H100))
    assert config.cost_prior == "linear"
    with pytest.raises(ValueError, match="@prior is ours'"):
        mode_settings("off@line", "cuda", cost_path=str(H100))


def test_on_the_line_prior_ours_fit_learns_the_device_while_the_exact_table_needs_nothing() -> None:
    groups = [TraceGroup(f"g{i}", _tokens(8, i), [_tokens(900, 10 * i + j) for j in range(4)]) for i in range(6)]
    groups += _looping_groups()
    table = _run(groups, "samrollout@table")
    line = _run(groups, "samrollout@line")
    assert line["config"].cost_prior == "linear" and table["config"].cost_prior != "linear"
    assert table["step_cost_fit"]["last_quarter_error"] < 0.01
    fit = line["step_cost_fit"]
    assert fit["first_quarter_error"] > 2 * table["step_cost_fit"]["last_quarter_error"]
    assert fit["last_quarter_error"] < fit["first_quarter_error"]


def test_a_seed_other_than_0_visits_the_prompts_in_an_order_of_its_own() -> None:
    groups = [TraceGroup(f"g{i}", _tokens(4, i), [_tokens(5, i)]) for i in range(8)]
    assert [g.key for g in _ordered(groups, 0)] == [g.key for g in groups]
    assert sorted(g.key for g in _ordered(groups, 1)) == sorted(g.key for g in groups)
    assert [g.key for g in _ordered(groups, 1)] != [g.key for g in groups]


def test_on_the_line_prior_a_batch_size_never_drafted_at_is_not_held_to_the_lines_draft_cost() -> None:
    """Before: an instance that only ever ran 32 rows kept the line's slope for drafts (about 40x an H100's at
    that batch), so the policy never drafted there and never measured it.  Now unmeasured drafts start free."""
    from samrollout.spec_decode.step_cost import LinearShape, StepCost

    truth = CostTable.load(H100)
    cost = StepCost(LinearShape())
    for _ in range(300):
        cost.observe(32, 32, 4000, truth.step_seconds(32, 1, 4000))
    plain, drafted = cost.seconds(32, np.array([32.0, 32.0 * 4]), 4000)
    true_extra = truth.step_seconds(32, 4, 4000) / truth.step_seconds(32, 1, 4000) - 1
    assert drafted / plain - 1 <= max(0.05, 2 * true_extra)


def test_on_the_line_prior_drafted_steps_teach_the_fit_that_drafts_cost_what_they_cost() -> None:
    """The other way round (a CPU, where drafts are dear): a few dozen drafted steps move the drafts' weight
    from free to what the device measured."""
    from samrollout.spec_decode.step_cost import LinearShape, StepCost

    device = LinearShape(step_s=0.02, token_s=0.002)  # the truth: a slow device, drafts cost 2 ms a token
    cost = StepCost(LinearShape())
    rng = np.random.default_rng(0)
    for _ in range(60):
        rows, q = 8, int(rng.integers(1, 6))
        cost.observe(rows, rows * q, 1000, float(device.seconds(rows, np.array([rows * q]), 1000)[0]))
    predicted = cost.seconds(8, np.array([8.0, 32.0]), 1000)
    true = device.seconds(8, np.array([8.0, 32.0]), 1000)
    assert abs((predicted[1] - predicted[0]) / (true[1] - true[0]) - 1) < 0.25
