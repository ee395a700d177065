"""The speculation config, the batch-size gates and group detection: the rules the proposer follows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from samrollout.config import SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.engine import PROPOSER_CLASS, engine_kwargs
from samrollout.spec_decode.gate import AdaptiveGate, Gate, StaticGate, make_gate
from samrollout.spec_decode.proposer import group_of
from samrollout.spec_decode.schedule import dense_schedule


def test_config_round_trips_through_vllm_additional_config():
    config = SpeculationConfig(k=4, threshold_mode="static", threshold=16, group_drafting=False,
                               policy=DraftPolicy(occurrence="first", min_match_length=2))
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

    spec = engine_kwargs("m", SpeculationConfig(k=3, threshold_mode="static", threshold=8))["speculative_config"]
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


def test_adaptive_gate_turns_speculation_off_where_verification_costs_more_than_it_gains():
    gate = AdaptiveGate(threshold=8, explore_every=10_000, explore_decided=10_000)
    # Small batches: a drafted step costs 1.2x a plain one and yields 2 tokens per request -> pays.
    # Big batches: a drafted step costs 3x a plain one and still yields 2 tokens per request -> does not.
    for _ in range(20):
        gate.observe_step(4, drafted=True, seconds=0.012, tokens=8)
        gate.observe_step(4, drafted=False, seconds=0.010, tokens=4)
        gate.observe_step(64, drafted=True, seconds=0.090, tokens=128)
        gate.observe_step(64, drafted=False, seconds=0.030, tokens=64)
    assert gate.speculation_pays(4) is True
    assert gate.speculation_pays(64) is False
    assert gate.allow_step(4) and not gate.allow_step(64)


def test_adaptive_gate_counts_requests_without_drafts_against_speculation():
    """High acceptance on the few requests that have drafts does not pay for verifying a big batch."""
    gate = AdaptiveGate(threshold=8, explore_every=10_000, explore_decided=10_000)
    for _ in range(20):
        # 32 running, 4 of them drafted and accepted all 3 tokens: 44 tokens in a step 1.5x as long.
        gate.observe_step(32, drafted=True, seconds=0.045, tokens=32 + 4 * 3)
        gate.observe_step(32, drafted=False, seconds=0.030, tokens=32)
    assert gate.speculation_pays(32) is False


def test_adaptive_gate_explores_the_losing_arm_so_it_notices_when_the_cost_changes():
    gate = AdaptiveGate(threshold=8, explore_every=4, explore_decided=4)
    decisions = [gate.allow_step(64) for _ in range(16)]
    assert decisions.count(True) == 4  # the static rule says no at 64; every 4th step tries drafting
    for _ in range(10):  # drafting turns out cheap at this size
        gate.observe_step(64, drafted=True, seconds=0.031, tokens=128)
        gate.observe_step(64, drafted=False, seconds=0.030, tokens=64)
    decisions = [gate.allow_step(64) for _ in range(16)]
    assert decisions.count(True) == 12


def test_adaptive_gate_follows_the_static_rule_until_it_has_measurements():
    gate = AdaptiveGate(threshold=8, explore_every=10_000)
    assert gate.speculation_pays(4) is None
    assert gate.allow_step(4) and not gate.allow_step(32)


def test_adaptive_gate_mutes_a_request_whose_drafts_keep_failing_then_retries_it():
    gate = AdaptiveGate(min_request_drafts=9, mute_steps=5)
    for _ in range(3):
        gate.observe_request("bad", drafted=3, accepted=0)
        gate.observe_request("good", drafted=3, accepted=3)
    assert not gate.allow_request("bad") and gate.allow_request("good")
    for _ in range(6):
        gate.allow_step(1)
    assert gate.allow_request("bad")


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
