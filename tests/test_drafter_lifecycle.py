"""Lifecycle, limits and bad input of the drafter: what a serving engine relies on."""

from __future__ import annotations

import enum
import threading
from dataclasses import fields

import numpy as np
import pytest

from samrollout import DraftPolicy, SamDrafter
from samrollout._core import core
from samrollout.drafter import Draft

VOCAB = 1000


def test_memory_returns_to_zero_after_thousands_of_requests_come_and_go():
    drafter = SamDrafter(VOCAB)
    rng = np.random.default_rng(1)
    for i in range(3000):
        drafter.add_request(f"req-{i}", rng.integers(0, VOCAB, size=64), group=f"g{i // 8}" if i % 3 else None)
        drafter.step([f"req-{i}"], [rng.integers(0, VOCAB, size=32)], 3)
        if i >= 16:
            drafter.remove_request(f"req-{i - 16}")
    for i in range(3000 - 16, 3000):
        drafter.remove_request(f"req-{i}")
    assert drafter.num_requests == 0
    assert drafter.num_groups == 0
    assert drafter.memory_bytes() == 0


def test_group_outlives_finished_siblings_until_the_last_one_leaves():
    drafter = SamDrafter(VOCAB, DraftPolicy(source="group", min_match_length=1))
    drafter.add_request("a", [1, 2], group="g")
    drafter.add_request("b", [1, 2], group="g")
    drafter.append("a", [5, 6, 7, 8])
    drafter.remove_request("a")
    drafter.append("b", [5, 6])
    assert drafter.propose("b", 2).tokens == [7, 8]
    drafter.remove_request("b")
    assert drafter.num_groups == 0


def test_sibling_with_a_different_prompt_drafts_alone():
    drafter = SamDrafter(VOCAB, DraftPolicy(source="group", min_match_length=1))
    assert drafter.add_request("a", [1, 2], group="g")
    assert not drafter.add_request("stranger", [9, 9, 9], group="g")
    assert drafter.info("stranger")["group"] == -1
    drafter.append("a", [3, 4, 5])
    drafter.append("stranger", [3, 4])
    assert drafter.propose("stranger", 3).tokens == []


def test_a_stranger_to_a_group_never_keeps_the_group_alive_after_its_members_leave():
    """The engine joins earlier rollouts' responses to a group it believes live: that belief must match
    the core's, or the join raises inside the engine (a request with a group's id but not its prompt)."""
    drafter = SamDrafter(VOCAB)
    drafter.add_request("member", [1, 2], group="g")
    drafter.add_request("stranger", [9, 9, 9], group="g")
    drafter.remove_request("member")
    assert not drafter.has_group("g") and drafter.num_groups == 0
    with pytest.raises(KeyError):
        drafter.add_to_group("g", [5, 6])
    drafter.remove_request("stranger")
    assert drafter.add_request("next", [1, 2], group="g") and drafter.has_group("g")


def test_a_sibling_continued_from_its_generated_tokens_joins_its_group_and_drafts_from_siblings():
    """Divided rollout resends a sample as prompt + the tokens it generated: it still drafts from its group."""
    siblings_text = list(range(100, 300))
    drafter = SamDrafter(VOCAB, DraftPolicy(source="group", min_match_length=1))
    drafter.add_request("ahead", [1, 2], group="g")
    drafter.append("ahead", siblings_text)
    assert drafter.add_request("continued", [1, 2, *siblings_text[:50]], group="g")
    assert drafter.info("continued")["num_tokens"] == 52
    step = drafter.step(["continued"], [siblings_text[50:51]], 3)
    assert step.tokens == [siblings_text[51:54]] and step.sources == ["group"]
    bounded = SamDrafter(VOCAB, DraftPolicy(max_group_tokens=100))
    bounded.add_request("ahead", [1, 2], group="g")
    assert not bounded.add_request("too long", [1, 2, *siblings_text], group="g")  # past the group bound: alone


def test_request_past_its_token_bound_stops_drafting_and_frees_its_automaton():
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1, max_request_tokens=100))
    drafter.add_request("r", [1, 2, 3] * 10)
    assert len(drafter.propose("r", 3).tokens) > 0
    before = drafter.memory_bytes()
    drafter.append("r", [1, 2, 3] * 30)
    assert drafter.info("r")["own_overflow"]
    assert drafter.propose("r", 3).tokens == []
    assert drafter.memory_bytes() < before
    drafter.append("r", [1, 2, 3])  # still accepted, still no drafts
    assert drafter.propose("r", 3).tokens == []


def test_group_past_its_bound_falls_back_to_the_requests_own_automaton():
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1, max_group_tokens=50))
    drafter.add_request("a", [1], group="g")
    drafter.add_request("b", [1], group="g")
    drafter.append("a", list(range(10, 70)))
    assert drafter.info("b")["group_overflow"]
    drafter.append("b", [4, 5, 6, 4, 5])
    assert drafter.propose("b", 3).tokens == [6, 4, 5]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda d: d.propose("missing", 3), KeyError),
        (lambda d: d.append("missing", [1]), KeyError),
        (lambda d: d.remove_request("missing"), KeyError),
        (lambda d: d.append("r", [-1]), ValueError),
        (lambda d: d.append("r", [VOCAB]), ValueError),
        (lambda d: d.append("r", [2**40]), ValueError),
        (lambda d: d.append("r", np.array([1.0, 2.0])), TypeError),
        (lambda d: d.append("r", ["a"]), TypeError),
        (lambda d: d.append("r", [[1, 2]]), ValueError),
        (lambda d: d.propose("r", 0), ValueError),
        (lambda d: d.propose("r", 65), ValueError),
        (lambda d: d.propose("r", 2.5), ValueError),
        (lambda d: d.add_request("r", [1]), ValueError),
        (lambda d: d.add_request("other", [1, -5]), ValueError),
        (lambda d: d.step(["r", "r"], [[1], [2]], 3), ValueError),
        (lambda d: d.step(["r"], [[1], [2]], 3), ValueError),
        (lambda d: d.step(["r", "missing"], [[1], [2]], 3), KeyError),
        (lambda d: d.step(["r"], [[1.5]], 3), TypeError),
        (lambda d: d.step(["r"], [5], 3), TypeError),
        (lambda d: d.step(["r"], [[-1]], 3), ValueError),
        (lambda d: d.step(["r"], [[2**40]], 3), ValueError),
        (lambda d: d.step(["r"], [[1]], 0), ValueError),
    ],
)
def test_bad_input_raises_a_clear_exception_and_leaves_state_intact(call, error):
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    drafter.add_request("r", [1, 2, 3, 1, 2])
    before = (drafter.propose("r", 3), drafter.info("r"))
    with pytest.raises(error):
        call(drafter)
    assert (drafter.propose("r", 3), drafter.info("r")) == before
    assert "other" not in drafter


def test_a_draft_comes_with_the_match_behind_it_and_its_source():
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    drafter.add_request("r", [1, 2, 3, 4, 1, 2, 3])
    drafter.add_request("fresh", [7])
    assert drafter.propose("r", 2) == Draft([4, 1], 3, "own", certain=2)  # "1 2 3" and "1 2 3 4" continued one way
    assert drafter.propose("fresh", 2) == Draft([], 0, None)
    step = drafter.step(["r", "fresh"], [[], []], 2)
    assert (step.tokens, step.match_lengths, step.sources, step.certain) == ([[4, 1], []], [3, 0], ["own", None],
                                                                             [2, 0])
    assert step[0] == drafter.propose("r", 2) and len(step) == 2
    handles = np.array([drafter.handle("r"), drafter.handle("fresh")], dtype=np.int64)
    arrays = drafter.step_arrays(handles, np.array([4], dtype=np.int32), np.array([0, 1, 1], dtype=np.int64), 3)
    assert arrays.drafts.tolist() == [[1, 2, 3], [-1, -1, -1]] and arrays.lengths.tolist() == [3, 0]
    assert arrays.match_lengths.tolist() == [4, 0] and arrays.sources.tolist()[1] == -1
    assert (arrays.source(0), arrays.source(1)) == ("own", None)


def test_native_step_rejects_inconsistent_arrays():
    drafter = SamDrafter(VOCAB)
    drafter.add_request("r", [1, 2])
    h = np.array([drafter.handle("r")], dtype=np.int64)
    with pytest.raises(ValueError, match="offsets"):
        drafter.step_arrays(h, np.array([1, 2], dtype=np.int32), np.array([0, 1], dtype=np.int64), 3)
    with pytest.raises(ValueError, match="offsets"):
        drafter.step_arrays(h, np.array([1], dtype=np.int32), np.array([0], dtype=np.int64), 3)
    with pytest.raises(TypeError):
        drafter.step_arrays(h, np.array([1], dtype=np.int64), np.array([0, 1], dtype=np.int64), 3)


@pytest.mark.parametrize(
    "policy",
    [
        {"occurrence": "last"},
        {"min_probability": 1.5},
        {"min_probability": -0.1},
        {"min_probability": True},
        {"source": "siblings"},
        {"min_match_length": 0},
        {"match_scale": -1.0},
        {"match_scale": float("nan")},
        {"max_request_tokens": 0},
        {"max_group_tokens": 2**31},
        {"min_match_length": 2.5},
        {"min_match_length": True},
        {"min_match_length": "sometimes"},
        {"group_margin": "4"},
        {"group_margin": 2**40},  # past the native int32: still a ValueError naming the field
        {"match_scale": "0.5"},
    ],
)
def test_invalid_policy_is_rejected_at_construction(policy):
    with pytest.raises(ValueError, match=next(iter(policy))):
        DraftPolicy(**policy)


def test_every_policy_field_is_set_by_name_on_the_native_policy_the_core_checks():
    """One definition: each dataclass field is the native struct's field of that name (enums by value name)."""
    policy = DraftPolicy(occurrence="frequent", min_probability=0.25, min_match_length=np.int64(3), match_scale=0.5,
                         source="own", group_margin=2, max_request_tokens=100, max_group_tokens=200,
                         max_global_tokens=300, global_margin=5)
    native = policy.native(VOCAB)
    assert native.vocab_size == VOCAB
    for knob in fields(DraftPolicy):
        value = getattr(native, knob.name)
        assert (value.name if isinstance(value, enum.Enum) else value) == getattr(policy, knob.name), knob.name
        assert knob.metadata["description"], f"{knob.name} has no description (the replay's --help uses it)"
    with pytest.raises(ValueError, match="min_match_length='auto' must be settled"):
        DraftPolicy().native(VOCAB)
    with pytest.raises(ValueError, match="max_request_tokens must be an integer between 1 and 1073741824, got 0"):
        DraftPolicy(max_request_tokens=0)  # the core's own check and message
    with pytest.raises(ValueError, match="vocab_size"):
        SamDrafter(0)


def test_the_native_policy_defaults_are_the_python_defaults():
    """One set of defaults: a policy made in C++ without settings drafts like `DraftPolicy()` outside an engine."""
    python, native = DraftPolicy().for_hardware(on_cpu=False).native(VOCAB), core.DraftPolicy()
    for knob in fields(DraftPolicy):
        assert getattr(native, knob.name) == getattr(python, knob.name), knob.name


def test_auto_min_match_length_is_settled_by_the_hardware_that_verifies_drafts():
    assert DraftPolicy().min_match_length == "auto"
    assert DraftPolicy().for_hardware(on_cpu=True).min_match_length == 2
    assert DraftPolicy().for_hardware(on_cpu=False).min_match_length == 1
    assert DraftPolicy(min_match_length=3).for_hardware(on_cpu=True).min_match_length == 3  # explicit values stay
    assert SamDrafter(VOCAB).policy.min_match_length == 1  # no engine: the accelerator value


def test_threads_sharing_one_drafter_get_the_same_drafts_as_one_thread():
    prompts = {t: np.random.default_rng(t).integers(0, 5, size=200) for t in range(4)}
    shared = SamDrafter(VOCAB)
    results: dict[int, list[list[int]]] = {}

    def worker(t: int) -> None:
        shared.add_request(t, prompts[t][:20])
        out = []
        for i in range(20, 200, 4):
            out.append(shared.step([t], [prompts[t][i: i + 4]], 3).tokens[0])
        results[t] = out

    threads = [threading.Thread(target=worker, args=(t,)) for t in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in prompts:
        alone = SamDrafter(VOCAB)
        alone.add_request(t, prompts[t][:20])
        expected = [alone.step([t], [prompts[t][i: i + 4]], 3).tokens[0] for i in range(20, 200, 4)]
        assert results[t] == expected
