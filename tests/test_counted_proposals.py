"""Counted continuations: the adaptive policy's proposals by occurrence counts (DraftPolicy.proposals="counted")."""

from __future__ import annotations

import numpy as np
import pytest

from samrollout.drafter import DraftPolicy, SamDrafter
from samrollout.replay.registry import make_drafter
from samrollout.replay.simulate import replay
from samrollout.replay.traces import TraceGroup

VOCAB = 100_000
PROMPT = [1, 2, 3]


def _drafter(proposals: str = "counted", min_probability: float = 0.0) -> SamDrafter:
    policy = DraftPolicy(proposals=proposals, min_probability=min_probability, min_match_length=1)  # type: ignore[arg-type]
    return SamDrafter(VOCAB, policy.for_hardware(on_cpu=False))


def _siblings_then_row(drafter: SamDrafter, responses: list[list[int]], row: list[int]) -> None:
    """Siblings that wrote ``responses`` (in order: the last is the most recent), then a row that wrote ``row``."""
    for i, response in enumerate(responses):
        drafter.add_request(f"sibling-{i}", PROMPT, group="g")
        drafter.append(f"sibling-{i}", response)
    drafter.add_request("row", PROMPT, group="g")
    drafter.append("row", row)


def test_the_counted_path_takes_the_majority_continuation_where_the_recent_copy_takes_the_latest() -> None:
    drafter = _drafter()
    _siblings_then_row(drafter, [[10, 11, 12, 20, 21], [10, 11, 12, 20, 21], [10, 11, 12, 30, 31]], [10, 11, 12])
    assert drafter.propose("row", 4).tokens == [30, 31]  # the latest sibling's text
    paths = drafter.counted_paths("row", 4)
    assert paths.main == [20, 21]  # two of the three siblings went on so
    assert paths.main_evidence == [(2, 3), (2, 2)]  # each token's count, of its context's continuations
    assert paths.match_length == len(PROMPT) + 3


def test_a_second_path_is_offered_where_the_counts_split_and_nowhere_else() -> None:
    split = _drafter()
    _siblings_then_row(split, [[10, 11, 12, 20, 21], [10, 11, 12, 20, 21], [10, 11, 12, 30, 31]], [10, 11, 12])
    assert split.counted_paths("row", 4).second == [30, 31]
    assert split.counted_paths("row", 4).second_evidence == [(1, 3), (1, 1)]
    agreed = _drafter()
    _siblings_then_row(agreed, [[10, 11, 12, 20, 21]] * 3, [10, 11, 12])
    assert agreed.counted_paths("row", 4).main == [20, 21]
    assert agreed.counted_paths("row", 4).second == []


@pytest.mark.parametrize(("min_probability", "main", "second"), [(0.0, [20, 21], [30, 31]), (0.5, [20, 21], []),
                                                                 (0.7, [], [])])
def test_counted_paths_stop_where_their_probability_estimate_falls_below_min_probability(
        min_probability: float, main: list[int], second: list[int]) -> None:
    drafter = _drafter(min_probability=min_probability)
    _siblings_then_row(drafter, [[10, 11, 12, 20, 21], [10, 11, 12, 20, 21], [10, 11, 12, 30, 31]], [10, 11, 12])
    paths = drafter.counted_paths("row", 4)
    assert (paths.main, paths.second) == (main, second)  # shares 2/3 then 1 (main), 1/3 then 1 (second)


def test_the_copies_policy_proposes_no_counted_paths() -> None:
    drafter = _drafter(proposals="copies")
    _siblings_then_row(drafter, [[10, 11, 12, 20, 21]] * 3, [10, 11, 12])
    assert drafter.counted_paths("row", 4).main == []


def _stream(slots: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Earlier responses made of slots "filler, context (3 tokens), continuation": three take the majority
    continuation of each context, the latest another; fillers are each response's own, so the longest match at a
    context is the context itself.  Returns (the responses, oldest first; the row's truth; the majority tokens)."""
    contexts = [[100 + 3 * i, 101 + 3 * i, 102 + 3 * i] for i in range(slots)]
    majority = [1000 + i for i in range(slots)]
    deviant = [2000 + i for i in range(slots)]

    def response(writer: int, continuations: list[int]) -> list[int]:
        return [t for i in range(slots) for t in (10_000 + 1000 * writer + i, *contexts[i], continuations[i])]

    return ([response(w, majority) for w in range(3)] + [response(3, deviant)], response(4, majority), majority)


def _continuations_drafted(proposals: str, slots: int = 80) -> list[bool]:
    """Step a row through the stream under the adaptive policy at a flat cost (every row drafts its chosen
    candidate whole); at each continuation position a draft reached (its tokens before it right), whether the
    draft had the row's continuation there."""
    responses, truth, _ = _stream(slots)
    drafter = _drafter(proposals)
    drafter.add_request("row", PROMPT, group="g")
    for response in responses:
        assert drafter.add_to_group("g", response)
    at, new, outcomes, k = 0, [truth[0]], [], 3
    while at < len(truth) - 1:
        chosen = drafter.step_goodput(["row"], [new], k, np.ones(1, dtype=np.uint8), np.full(1, k, dtype=np.int32),
                                      np.ones(1), np.ones(k + 1))
        at += len(new)
        draft = chosen.drafts[0, :chosen.lengths[0]].tolist()
        accepted = 0
        while accepted < len(draft) and at + accepted < len(truth) and draft[accepted] == truth[at + accepted]:
            accepted += 1
        if accepted < len(draft) and (at + accepted) % 5 == 4:
            outcomes.append(False)  # reached the continuation and missed it
        outcomes += [True for p in range(at, at + accepted) if p % 5 == 4]
        new = truth[at:at + accepted + 1]
    return outcomes


def test_the_adaptive_policy_learns_to_draft_the_counted_path_where_it_is_accepted_more() -> None:
    counted = _continuations_drafted("counted")
    later = counted[len(counted) // 2:]
    assert len(later) >= 30 and sum(later) >= 0.9 * len(later)  # after learning, the majority's continuation
    copies = _continuations_drafted("copies")
    assert len(copies) >= 60 and not any(copies)  # the latest response's continuation: never the row's


def test_the_adaptive_drafters_replay_at_equal_k_every_round() -> None:
    rng = np.random.default_rng(0)
    loops = [np.tile(rng.integers(50, 500, size=10), 30).astype(np.int32) for _ in range(6)]  # looping responses
    groups = [TraceGroup(f"p{g}", np.array([*PROMPT, g], dtype=np.int32), loops[3 * g:3 * g + 3], [{}] * 3)
              for g in range(2)]
    for name in ("sam-adaptive", "sam-counted"):
        result = replay(make_drafter(name, VOCAB), groups, 3, 8, None, [[] for _ in groups])
        assert result.drafting_steps == result.row_steps  # drafts in every round
        assert result.mean_acceptance_length > 3.5  # a loop is drafted whole at k = 3 after its first period


def _split_stream(slots: int) -> tuple[list[list[int]], list[int]]:
    """Earlier responses in slots "filler, context (3 tokens), continuation" whose counts are the same in every slot
    (the majority M twice, another continuation D once) but whose order alternates: in even slots D is the latest
    (the recent copy and the second path agree on D, the majority stands alone), in odd slots M is (the recent
    copy and the majority agree, the second path stands alone).  The row's truth is the lone candidate in each.
    Returns (the responses, the row's truth)."""
    contexts = [[100 + 3 * i, 101 + 3 * i, 102 + 3 * i] for i in range(slots)]
    majority = [1000 + i for i in range(slots)]
    other = [2000 + i for i in range(slots)]
    order = [(majority, majority, other) if i % 2 == 0 else (majority, other, majority) for i in range(slots)]
    responses = [[t for i in range(slots) for t in (10_000 + 1000 * w + i, *contexts[i], order[i][w][i])]
                 for w in range(3)]
    truth = [t for i in range(slots) for t in (50_000 + i, *contexts[i], (majority if i % 2 == 0 else other)[i])]
    return responses, truth


def test_the_chooser_tells_candidates_with_the_same_counts_apart_by_their_agreement_with_the_others() -> None:
    responses, truth = _split_stream(120)
    drafter = _drafter()
    drafter.add_request("row", PROMPT, group="g")
    for response in responses:
        assert drafter.add_to_group("g", response)
    at, new, hits, k = 0, [truth[0]], [], 1
    while at < len(truth) - 1:
        chosen = drafter.step_goodput(["row"], [new], k, np.ones(1, dtype=np.uint8), np.full(1, k, dtype=np.int32),
                                      np.ones(1), np.ones(k + 1))
        at += len(new)
        accepted = int(chosen.lengths[0] > 0 and chosen.drafts[0, 0] == truth[at])
        if at % 5 == 4:  # a continuation: the candidates differ only here
            hits.append(bool(accepted))
        new = truth[at:at + accepted + 1]
    later = hits[len(hits) // 2:]
    assert len(later) == 60 and sum(later) >= 0.9 * len(later)  # learned: the lone candidate, whichever kind it is
