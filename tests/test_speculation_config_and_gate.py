"""The speculation config, the batch-size gates and group detection: the rules the proposer follows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import EngineRun, planned_runs
from samrollout.config import SpeculationConfig, default_critical_path, default_draft_range, parse_draft_range
from samrollout.drafter import DraftPolicy
from samrollout.engine import PROPOSER_CLASS, engine_kwargs
from samrollout.spec_decode.gate import Gate, StaticGate, make_gate
from samrollout.spec_decode.proposer import group_of
from samrollout.spec_decode.schedule import dense_from_range, dense_schedule, range_schedule
from samrollout.spec_decode.session import DraftSession, SessionSettings, StepRow
from samrollout.spec_decode.stats import ProposerStats


def test_config_round_trips_through_vllm_additional_config():
    config = SpeculationConfig(k=4, threshold_mode="static", threshold=16, group_drafting=False,
                               policy=DraftPolicy(occurrence="first", min_match_length=2), confident_match=0)
    kwargs = engine_kwargs("model-dir", config, max_model_len=1024)
    assert kwargs["speculative_config"] == {"method": "custom_class", "model": PROPOSER_CLASS,
                                            "num_speculative_tokens": 4,
                                            "num_speculative_tokens_per_batch_size": [[1, 16, 4], [17, 17, 0]]}
    assert SpeculationConfig.from_json(kwargs["additional_config"]["samrollout"]) == config
    assert kwargs["max_model_len"] == 1024
    assert "speculative_config" not in engine_kwargs("model-dir", None)


@pytest.mark.parametrize(
    "bad",
    [{"k": 0}, {"k": 17}, {"threshold_mode": "sometimes"}, {"threshold": 0}, {"group_drafting": "yes"},
     {"sampled_requests": "maybe"}],
)
def test_invalid_speculation_settings_fail_at_startup(bad):
    with pytest.raises(ValueError):
        SpeculationConfig(**bad)


def test_unknown_settings_are_rejected_not_dropped():
    with pytest.raises(ValueError, match="unknown"):
        SpeculationConfig.from_json({"k": 3, "treshold": 8})
    with pytest.raises(ValueError, match="unknown draft policy fields"):
        SpeculationConfig.from_json({"k": 3, "policy": {"min_match": 2}})


def test_static_gate_drafts_only_in_the_tail():
    gate = StaticGate(8)
    assert gate.allow_step(1) and gate.allow_step(8)
    assert not gate.allow_step(9)
    assert isinstance(make_gate(SpeculationConfig(threshold_mode="static")), StaticGate)
    assert type(make_gate(SpeculationConfig(threshold_mode="off"))) is Gate


def test_static_threshold_is_vllms_batch_size_schedule_where_vllm_has_one():
    from vllm.config import SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    spec = engine_kwargs("m", SpeculationConfig(k=3, threshold_mode="static", threshold=8,
                                                confident_match=0))["speculative_config"]
    schedule = spec["num_speculative_tokens_per_batch_size"]
    assert "num_speculative_tokens_per_batch_size" in SpeculativeConfig.__dataclass_fields__  # vLLM 0.32
    validate_and_normalize_dynamic_sd_schedule(schedule)  # vLLM's own check passes
    engine = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3, **{
        "num_speculative_tokens_per_batch_size": schedule}), scheduler_config=SimpleNamespace(max_num_seqs=64))
    lookup = dense_schedule(engine)  # expanded by vLLM's scheduler function
    assert lookup is not None and lookup[1:9] == [3] * 8 and set(lookup[9:]) == {0} and len(lookup) == 65
    gate = make_gate(SpeculationConfig(threshold_mode="static", threshold=8), lookup)
    assert [gate.allow_step(n) for n in (1, 8, 9, 64, 500)] == [True, True, False, False, False]
    assert gate.draft_limit(4, 3) == 3
    for mode in ("off", "adaptive"):  # the schedule is the static rule only
        assert "num_speculative_tokens_per_batch_size" not in engine_kwargs(
            "m", SpeculationConfig(threshold_mode=mode))["speculative_config"]


def test_a_schedule_can_shorten_drafts_per_batch_size():
    gate = StaticGate(8, schedule=[0, 3, 3, 2, 2, 1, 0])
    assert [gate.draft_limit(n, 3) for n in (1, 3, 5, 6, 100)] == [3, 2, 1, 0, 0]
    assert gate.allow_step(5) and not gate.allow_step(6)


@pytest.mark.parametrize(
    ("request_id", "extra_args", "group"),
    [
        ("cmpl-1-abcd1234", {"samrollout_group": "prompt-7"}, "prompt-7"),
        ("3_cmpl-9-ab12cd34", None, "n:cmpl-9"),
        ("0_cmpl-9-ffffffff", {}, "n:cmpl-9"),
        ("cmpl-2-abcd1234", None, None),
        ("12_req", None, "n:req"),
    ],
)
def test_siblings_are_found_from_the_group_field_or_the_n_child_request_id(request_id, extra_args, group):
    assert group_of(request_id, extra_args) == group


# 16 greedy requests at once (past the threshold of 8: vLLM's schedule gives them no drafts), then 2 (the tail).
SCHEDULE_JOBS = [{"name": "big", "prompts": [f"tail {i} tail {i} tail {i} tail" for i in range(16)],
                  "params": {"temperature": 0, "max_tokens": 24, "ignore_eos": True}},
                 {"name": "tail", "prompts": ["tail 1 tail 1 tail 1 tail", "tail 2 tail 2 tail 2 tail"],
                  "params": {"temperature": 0, "max_tokens": 96, "ignore_eos": True}}]
SCHEDULE_SPECULATION = {"k": 3, "threshold_mode": "static", "threshold": 8, "confident_match": 0,
                        "policy": {"min_match_length": 1}}


def engine_plan(tiny_dir: Path, smollm2_dir: Path, base: Path) -> dict[str, EngineRun]:
    """The schedule test's engine, run in the exactness modules' pool (`planned_engine_runs`)."""
    return {"schedule": EngineRun(tiny_dir, SCHEDULE_SPECULATION, SCHEDULE_JOBS, base / "schedule", expected_s=25.0)}


def test_without_confident_drafts_vllms_batch_size_schedule_drafts_only_in_the_tail(
        planned_engine_runs: dict[str, Any]) -> None:
    proposer = ProposerStats.from_json(planned_runs(planned_engine_runs, __name__)["schedule"]["proposer"])
    assert proposer.threshold_from_vllm_schedule is True and proposer.confident_drafts == 0
    steps, drafting = proposer.steps_by_batch_size, proposer.drafting_steps_by_batch_size
    assert max(steps) == 16 and drafting and max(drafting) <= 8


def test_draft_range_round_trips_and_sets_vllms_largest_draft():
    config = SpeculationConfig(threshold_mode="static", draft_range=((2, 16), (8, 8)), confident_match=0)
    assert SpeculationConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    spec = engine_kwargs("m", config)["speculative_config"]
    assert spec["num_speculative_tokens"] == 16
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 16], [3, 8, 8], [9, 9, 0]]
    assert SpeculationConfig(k=5, threshold_mode="static").largest_draft() == 5
    assert SpeculationConfig(threshold_mode="off", draft_range=((2, 16),)).largest_draft() == 3  # static only
    assert SpeculationConfig(k=5, max_draft=20).largest_draft() == 20  # adaptive: its longest draft


def test_confident_drafts_past_the_threshold_leave_vllm_without_a_batch_size_schedule():
    config = SpeculationConfig(threshold_mode="static", draft_range=((2, 16), (8, 8)), confident_match=8)
    spec = engine_kwargs("m", config)["speculative_config"]
    assert spec["num_speculative_tokens"] == 16  # the proposer applies the range and drafts past it itself
    assert "num_speculative_tokens_per_batch_size" not in spec


def test_draft_range_is_one_schedule_with_or_without_vllms():
    """vLLM 0.32 expands the schedule; on 0.23 / 0.33 the proposer's gate applies the same one."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    draft_range = ((2, 16), (8, 8), (12, 3))
    ours = dense_from_range(draft_range)
    vllms = build_dynamic_sd_schedule_lookup(range_schedule(draft_range), vllm_max_batch_size=64,
                                             vllm_num_speculative_tokens=16)
    assert ours[1:] == vllms[1:len(ours)] and set(vllms[len(ours):]) <= {0}
    gate = StaticGate(8, ours)
    assert [gate.draft_limit(n, 16) for n in (1, 2, 3, 8, 9, 12, 13, 500)] == [16, 16, 8, 8, 3, 3, 0, 0]


@pytest.mark.parametrize("text", ["", "8", "8:17", "8:8,4:3", "0:3", "a:b", "8:0"])
def test_a_bad_draft_range_is_refused_with_how_to_write_it(text):
    with pytest.raises(ValueError, match="draft"):
        parse_draft_range(text)


def test_auto_draft_range_drafts_long_in_the_tail_on_cuda_only():
    assert default_draft_range("auto", 3, 8, "cuda") == ((32, 8), (256, 3))
    assert default_draft_range("auto", 12, 8, "cuda") == ((32, 12), (256, 12))
    assert default_draft_range("auto", 3, 8, "cpu") is None
    assert default_draft_range("auto", 3, 8, "npu") is None
    assert default_draft_range("none", 3, 8, "cuda") is None
    assert default_draft_range("1:16,4:8", 3, 8, "cpu") == ((1, 16), (4, 8))


def test_critical_path_auto_drafts_for_the_longest_running_rows_on_cuda_only():
    assert default_critical_path("auto", "cuda") == (8, 8)
    assert default_critical_path("auto", "cpu")[0] == 0
    assert default_critical_path("none", "cuda")[0] == 0
    assert default_critical_path("2:24", "npu") == (2, 24)
    for bad in ("8", "a:b", "2:0", "2:65", "-1:8"):
        with pytest.raises(ValueError, match="critical path"):
            default_critical_path(bad, "cuda")


def test_critical_path_drafts_set_vllms_largest_draft_and_leave_the_range_to_the_proposer():
    config = SpeculationConfig(threshold_mode="static", confident_match=0, critical_rows=2, critical_k=24)
    assert SpeculationConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    spec = engine_kwargs("m", config)["speculative_config"]
    assert spec["num_speculative_tokens"] == 24
    assert "num_speculative_tokens_per_batch_size" not in spec  # vLLM would cut the rows past the threshold


def _session_rows(outputs: list[int], cycle: list[int], prompt_length: int = 4) -> list[StepRow]:
    """Rows whose outputs repeat ``cycle`` (so each has a long match), ``outputs[i]`` tokens long."""
    rows = []
    for i, length in enumerate(outputs):
        tokens = [1, 2, 3, 4] + [cycle[j % len(cycle)] for j in range(length)]
        rows.append(StepRow(f"r{i}", 1, tokens, len(tokens), prompt_length))
    return rows


def test_past_the_threshold_only_the_rows_that_have_run_longest_get_critical_path_drafts():
    config = SpeculationConfig(k=3, threshold_mode="static", threshold=2, confident_match=0, critical_rows=2,
                               critical_k=12)
    session = DraftSession(config, 64, SessionSettings(largest_draft=config.largest_draft(), confident_k=3))
    cycle = [10, 11, 12, 13, 14, 15, 16]
    rows = _session_rows([60, 50, 40, 40, 40, 40], cycle)
    drafts = session.step(rows, {row.request_id for row in rows})
    lengths = [len(d) for d in drafts]
    assert 3 < lengths[1] <= lengths[0] == 12 and lengths[2:] == [0, 0, 0, 0]  # 6 running: past the threshold
    assert drafts[0] == [cycle[(60 + j) % len(cycle)] for j in range(12)]
    assert session.stats().critical_drafts == 2


def test_rows_that_started_together_are_no_critical_path_evidence():
    config = SpeculationConfig(k=3, threshold_mode="static", threshold=2, confident_match=0, critical_rows=2,
                               critical_k=12)
    session = DraftSession(config, 64, SessionSettings(largest_draft=config.largest_draft(), confident_k=3))
    rows = _session_rows([40, 40, 40, 40], [10, 11, 12, 13, 14])
    assert session.step(rows, {row.request_id for row in rows}) == [[], [], [], []]
    tail = _session_rows([40, 30], [10, 11, 12, 13, 14])  # at the threshold: the range's 3, the longest 12
    fresh = DraftSession(config, 64, SessionSettings(largest_draft=config.largest_draft(), confident_k=3))
    assert all(len(d) > 3 for d in fresh.step(tail, {row.request_id for row in tail}))


def _stepped_session() -> DraftSession:
    """A session with the history on and the adaptive policy that has drafted, accepted and measured a few steps."""
    config = SpeculationConfig(max_draft=3, threshold_mode="adaptive", history_tokens=1000)
    session = DraftSession(config, 64, SessionSettings(largest_draft=3, confident_k=3))
    tokens = [1, 2, 3, 4, 5] * 8
    for length in range(20, 30):
        session.step([StepRow("a", 1, tokens, length, 10)], {"a"}, now=length / 100)
    return session


def test_proposer_stats_cross_processes_as_strict_json_and_read_back_the_same():
    stats = _stepped_session().stats()
    assert stats.steps == 10 and stats.draft_tokens > 0 and stats.steps_by_batch_size == {1: 10}
    assert stats.history is not None and stats.no_draft_sampling_patched is None  # no vLLM worker asked
    assert list(stats.step_cost) == ["<2"] and stats.step_cost["<2"][3] == 9  # 9 decode steps measured at 1 row
    data = json.loads(json.dumps(stats.to_json(), allow_nan=False))  # plain JSON
    assert data["steps_by_batch_size"] == {"1": 10} and len(data["step_cost"]["<2"]) == 4
    back = ProposerStats.from_json(data)
    assert back.to_json() == stats.to_json() and back == stats


@pytest.mark.parametrize("change", [
    lambda d: d.update(acceptance_tokens=1),                    # a key nobody reads
    lambda d: d.pop("accepted_tokens"),                         # a key renamed away
    lambda d: d.update(steps="10"),                             # a value of the wrong type
    lambda d: d.update(step_seconds_counts=[0, 1]),             # a histogram of other buckets
    lambda d: d["sources"].pop("global"),
    lambda d: d["history"].update(joined=1),
    lambda d: d["policy"].pop("source"),
    lambda d: d.update(threshold_mode="sometimes"),
    lambda d: d["step_cost"].update({"<4": [1.0, 0.0, 1.0]}),     # a fit without its observations
])
def test_proposer_stats_with_unknown_missing_or_mistyped_keys_are_refused(change):
    data = json.loads(json.dumps(_stepped_session().stats().to_json()))
    change(data)
    with pytest.raises(ValueError, match="proposer stats"):
        ProposerStats.from_json(data)


def test_drafter_metrics_read_the_typed_stats():
    from samrollout.metrics import definitions as m
    from samrollout.metrics.drafter import DrafterCollector

    collector = DrafterCollector()
    assert list(collector.collect()) == []  # nothing before the first snapshot
    stats = _stepped_session().stats()
    collector.update(stats)
    assert m.SPECULATION_K._value.get() == 3 and m.DRAFTER_ACTIVE_REQUESTS._value.get() == 1
    families = {family.name: family for family in collector.collect()}
    drafted = {s.labels["source"]: s.value for s in families["samrollout_drafter_source_draft_tokens"].samples
               if s.name.endswith("_total")}
    assert drafted == {source: counts.draft_tokens for source, counts in stats.sources.items()}
    histogram = families["samrollout_drafter_step_seconds"].samples
    assert [s.value for s in histogram if s.name.endswith("_count")] == [stats.steps]
    history = {name: families[f"samrollout_drafter_history_{name}"].samples[0].value
               for name in ("groups", "hit_groups")}
    assert history == {"groups": 1, "hit_groups": 0}  # one request, its prompt new to the history
    collector.update(None)  # speculation off
    assert m.SPECULATION_ACTIVE._value.get() == 0 and list(collector.collect()) == []
