"""The native drafter proposes exactly what a brute-force search of the history finds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from samrollout import DraftPolicy, SamDrafter
from support.oracle import expected_length, group_occurrences, own_continuation, own_occurrences

VOCAB = 50
repetitive = st.lists(st.integers(0, 2), min_size=0, max_size=60)
random_tokens = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=60)
sequences = st.one_of(repetitive, random_tokens)


@settings(max_examples=300, deadline=None)
@given(prompt=sequences, output=sequences, k=st.integers(1, 8), min_match=st.integers(1, 4),
       scale=st.sampled_from([0.0, 0.5, 1.0]), chunk=st.integers(1, 5))
def test_first_occurrence_draft_equals_brute_force_after_every_append(prompt, output, k, min_match, scale, chunk):
    drafter = SamDrafter(VOCAB, DraftPolicy(occurrence="first", min_match_length=min_match, match_scale=scale))
    drafter.add_request("r", prompt)
    for seq in _appended_in_chunks(drafter, "r", prompt, output, chunk):
        length, ends = own_occurrences(seq)
        draft = drafter.propose("r", k).tokens
        if ends:
            e = min(ends)
            assert draft == own_continuation(seq, e, expected_length(length, k, min_match, scale))
        else:
            assert draft == []
        assert drafter.info("r")["match_length"] == length


def _appended_in_chunks(drafter, request, prompt, output, chunk):
    """The request's whole sequence before any append, then after appending each ``chunk`` tokens of ``output``."""
    seq = list(prompt)
    yield seq
    for position in range(0, len(output), chunk):
        piece = output[position: position + chunk]
        drafter.append(request, piece)
        seq += piece
        yield seq


@settings(max_examples=300, deadline=None)
@given(tokens=sequences, k=st.integers(1, 8))
def test_recent_occurrence_draft_continues_some_longest_earlier_match(tokens, k):
    drafter = SamDrafter(VOCAB, DraftPolicy(occurrence="recent", min_match_length=1))
    drafter.add_request("r", [])
    seq: list[int] = []
    for token in tokens:
        drafter.append("r", [token])
        seq.append(token)
        length, ends = own_occurrences(seq)
        draft = drafter.propose("r", k).tokens
        assert drafter.info("r")["match_length"] == length
        if not ends:
            assert draft == []
            continue
        assert any(draft == own_continuation(seq, e, k) for e in ends)


def _most_frequent_continuations(seq: list[int], ends: list[int]) -> tuple[set[int], float]:
    """The tokens that most often followed the earlier occurrences ending at ``ends``, and their share."""
    counts: dict[int, int] = {}
    for e in ends:
        counts[seq[e + 1]] = counts.get(seq[e + 1], 0) + 1
    best = max(counts.values())
    return {token for token, count in counts.items() if count == best}, best / len(ends)


@settings(max_examples=300, deadline=None)
@given(prompt=sequences, output=sequences, k=st.integers(1, 8),
       min_probability=st.sampled_from([0.0, 0.4, 0.7, 1.0]), chunk=st.integers(1, 5))
def test_frequent_occurrence_drafts_the_most_frequent_continuation_of_the_longest_match(
        prompt, output, k, min_probability, chunk):
    drafter = SamDrafter(VOCAB, DraftPolicy(occurrence="frequent", min_match_length=1,
                                            min_probability=min_probability))
    drafter.add_request("r", prompt)
    for seq in _appended_in_chunks(drafter, "r", prompt, output, chunk):
        length, ends = own_occurrences(seq)
        draft = drafter.propose("r", k).tokens
        if not ends:
            assert draft == []
        else:
            best, share = _most_frequent_continuations(seq, ends)
            if share < min_probability:
                assert draft == []  # not even its first token is likely enough
            else:
                assert 1 <= len(draft) <= k and draft[0] in best
        assert drafter.info("r")["match_length"] == length


def test_frequent_occurrence_follows_the_majority_of_the_siblings():
    drafter = SamDrafter(VOCAB, DraftPolicy(occurrence="frequent", source="group", min_match_length=1))
    for member, response in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9]]):
        drafter.add_request(member, [7], group="g")
        drafter.append(member, response)
    drafter.add_request("behind", [7], group="g")
    drafter.append("behind", [1, 2])
    # "first" would follow the first sibling too; "recent" the last one, whose 9 9 two siblings contradict.
    assert drafter.propose("behind", 2).tokens == [3, 4]
    strict = SamDrafter(VOCAB, DraftPolicy(occurrence="frequent", source="group", min_match_length=1,
                                           min_probability=0.9))
    for member, response in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9]]):
        strict.add_request(member, [7], group="g")
        strict.append(member, response)
    strict.add_request("behind", [7], group="g")
    strict.append("behind", [1, 2])
    assert strict.propose("behind", 2).tokens == []  # 3 follows "1 2" in two of three siblings: 0.67 < 0.9


def test_frequent_occurrence_drafts_a_long_run_of_one_token():
    drafter = SamDrafter(VOCAB, DraftPolicy(occurrence="frequent", min_match_length=1))
    drafter.add_request("r", [3] * 5000)  # a suffix-link path of 5,000 states: counted along a bounded part
    assert drafter.propose("r", 8).tokens == [3] * 8


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), max_size=12),
       script=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=0, max_size=4)),
                       max_size=40),
       occurrence=st.sampled_from(["first", "recent"]), k=st.integers(1, 6))
def test_group_match_is_the_longest_anywhere_in_the_group_and_drafts_continue_it(prompt, script, occurrence, k):
    drafter = SamDrafter(VOCAB, DraftPolicy(occurrence=occurrence, source="group", min_match_length=1))
    members = 4
    responses: list[list[int]] = [[] for _ in range(members)]
    active = set(range(members))
    for m in range(members):
        drafter.add_request(m, prompt, group="g")
    for member, piece in script:
        if member not in active:
            continue
        if not piece:  # an empty piece finishes the member (its text stays in the group), except the last one
            if len(active) > 1:
                drafter.remove_request(member)
                active.discard(member)
            continue  # appending nothing is no step: matches refresh when a member appends tokens
        drafter.append(member, piece)
        responses[member] += piece
        # A member's match is refreshed when it appends (siblings' later text is seen at its next step).
        assert drafter.info(member)["match_length"] == group_occurrences(prompt, responses, member)[0]
        for m in active:
            length = drafter.info(m)["match_length"]
            draft = drafter.propose(m, k).tokens
            if not draft:
                continue
            me = list(prompt) + responses[m]
            # Some occurrence of a suffix of `me` (any length) ends where the draft starts.
            assert any(
                (s[e + 1: e + 1 + len(draft)] == draft or (s == me and own_continuation(me, e, len(draft)) == draft))
                and any(s[max(0, e - L + 1): e + 1] == me[len(me) - L:] for L in range(1, length + 1))
                for s, e in _all_ends(prompt, responses, m)
            )


def _all_ends(prompt, responses, member):
    strings = [list(prompt) + list(r) for r in responses]
    ends = [(list(prompt) + list(responses[member]), e) for e in range(len(prompt))]
    for s in strings:
        ends += [(s, e) for e in range(len(s) - 1)]
    return ends


def test_a_loop_shorter_than_k_is_drafted_in_full():
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    drafter.add_request("r", [5, 6, 5, 6, 5])
    assert drafter.propose("r", 5).tokens == [6, 5, 6, 5, 6]
    drafter.add_request("s", [9, 9, 9])
    assert drafter.propose("s", 4).tokens == [9, 9, 9, 9]


def test_sibling_behind_drafts_what_the_sibling_ahead_wrote():
    drafter = SamDrafter(VOCAB, DraftPolicy(source="group", min_match_length=1))
    prompt = [1, 2, 3]
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter.add_request("ahead", prompt, group=7)
    drafter.add_request("behind", prompt, group=7)
    drafter.append("ahead", answer)
    drafter.append("behind", answer[:3])
    assert drafter.propose("behind", 4).tokens == answer[3:7]
    solo = SamDrafter(VOCAB, DraftPolicy(source="own", min_match_length=1))
    solo.add_request("behind", prompt)
    solo.append("behind", answer[:3])
    assert solo.propose("behind", 4).tokens == []


def test_both_sources_prefer_the_longer_match():
    drafter = SamDrafter(VOCAB, DraftPolicy(source="both", min_match_length=1, occurrence="first"))
    prompt = [1]
    drafter.add_request("a", prompt, group="g")
    drafter.add_request("b", prompt, group="g")
    drafter.append("a", [5, 6, 7, 8, 9, 20, 21])
    drafter.append("b", [7, 30, 5, 6, 7, 8])  # own history: 7 -> 30; sibling: 5 6 7 8 -> 9 20
    assert drafter.propose("b", 2).tokens == [9, 20]


@pytest.mark.parametrize(("margin", "expected"), [(0, [9, 20]), (1, [9, 20]), (2, [31, 5])])
def test_group_match_must_beat_the_own_match_by_more_than_the_margin(margin, expected):
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1, occurrence="first", group_margin=margin))
    drafter.add_request("a", [1], group="g")
    drafter.add_request("b", [1], group="g")
    drafter.append("a", [6, 7, 8, 9, 20, 21])
    drafter.append("b", [8, 31, 5, 6, 7, 8])  # own: "8" -> 31 5 (match 1); group: "6 7 8" -> 9 20 (match 3)
    assert drafter.propose("b", 2).tokens == expected


def test_batched_step_equals_one_call_per_request():
    rng = np.random.default_rng(0)
    policy = DraftPolicy(min_match_length=1)
    batched, single = SamDrafter(VOCAB, policy), SamDrafter(VOCAB, policy)
    prompts = [rng.integers(0, 4, size=20) for _ in range(6)]
    for i, p in enumerate(prompts):
        batched.add_request(i, p, group=i % 2)
        single.add_request(i, p, group=i % 2)
    for _ in range(30):
        rows = sorted(rng.choice(6, size=rng.integers(1, 7), replace=False).tolist())
        new = [rng.integers(0, 4, size=rng.integers(0, 4)) for _ in rows]
        drafts = batched.step(rows, new, 3)
        for i, (row, tokens) in enumerate(zip(rows, new, strict=True)):
            single.append(row, tokens)
            assert drafts[i] == single.propose(row, 3)  # tokens, match length and source alike
