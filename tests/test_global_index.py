"""The global index: finished responses to any prompt draft for later requests, bounded, and only where they win."""

from __future__ import annotations

import numpy as np
import pytest

from samrollout import DraftPolicy, SamDrafter

VOCAB = 1000


def _text(length: int, seed: int) -> list[int]:
    """Tokens without repeats: nothing in them predicts their own continuation."""
    return np.random.default_rng(seed).permutation(VOCAB)[:length].tolist()


def _finish(drafter: SamDrafter, request_id: str, prompt: list[int], response: list[int]) -> None:
    drafter.add_request(request_id, prompt)
    drafter.append(request_id, response)
    drafter.remove_request(request_id)


def test_a_finished_response_to_another_prompt_drafts_a_later_request_through_the_global_index():
    earlier = _text(200, seed=1)
    on = SamDrafter(VOCAB, DraftPolicy(max_global_tokens=10_000, min_match_length=1))
    off = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    for drafter in (on, off):
        _finish(drafter, "earlier", [1, 2, 3], earlier)
        drafter.add_request("later", [4, 5, 6])  # another prompt: no group, no history
    # The later request reaches a passage the earlier response wrote.
    step = on.step(["later"], [earlier[50:60]], 5)
    assert step.tokens == [earlier[60:65]] and step.sources == ["global"]
    assert on.global_tokens == 200
    step = off.step(["later"], [earlier[50:60]], 5)
    assert step.tokens == [[]] and step.sources == [None] and step.match_lengths == [0] and off.global_tokens == 0


def test_the_global_index_keeps_the_newest_responses_within_its_token_bound():
    drafter = SamDrafter(VOCAB, DraftPolicy(max_global_tokens=1000, min_match_length=1))
    responses = [_text(200, seed=10 + i) for i in range(8)]
    for i, response in enumerate(responses):
        _finish(drafter, f"r{i}", [1], response)
        assert drafter.global_tokens <= 1000
    drafter.add_request("newest", [7])
    assert drafter.step(["newest"], [responses[-1][:40]], 3).tokens == [responses[-1][40:43]]
    drafter.add_request("oldest", [8])
    assert drafter.step(["oldest"], [responses[0][:40]], 3).tokens != [responses[0][40:43]]  # evicted
    drafter.add_request("huge", [9])
    drafter.append("huge", _text(600, seed=99))  # longer than a generation (half the bound): not indexed
    drafter.remove_request("huge")
    assert drafter.global_tokens <= 1000


@pytest.mark.parametrize(("own_match", "winner"), [(7, "own"), (4, "global")])
def test_the_requests_own_match_wins_unless_the_global_match_is_longer_by_the_margin(own_match, winner):
    shared = _text(60, seed=3)
    drafter = SamDrafter(VOCAB, DraftPolicy(max_global_tokens=10_000, min_match_length=1, global_margin=4))
    _finish(drafter, "earlier", [1], shared)
    # The request wrote the last `own_match` tokens of shared[40:50] before, followed by 800.
    drafter.add_request("later", [2, *shared[50 - own_match:50], 800, 801, 802, 803])
    draft = drafter.step(["later"], [shared[40:50]], 3)[0]  # global match: 10 tokens
    expected = {"own": [800, 801, 802], "global": shared[50:53]}[winner]
    assert draft.tokens == expected and draft.source == winner
    assert draft.match_length == {"own": own_match, "global": 10}[winner]


def test_global_index_settings_are_checked():
    with pytest.raises(ValueError, match="max_global_tokens"):
        DraftPolicy(max_global_tokens=-1)
    with pytest.raises(ValueError, match="global_margin"):
        DraftPolicy(global_margin=-2)
    assert DraftPolicy().max_global_tokens == 0  # off by default (see DraftPolicy)
    assert DraftPolicy.from_dict(DraftPolicy(max_global_tokens=64).as_dict()).max_global_tokens == 64


def _occurs(needle: list[int], haystacks: list[list[int]]) -> bool:
    n = len(needle)
    return any(h[i:i + n] == needle for h in haystacks for i in range(len(h) - n + 1))


@pytest.mark.parametrize("seed", range(4))
def test_every_global_draft_continues_a_finished_response_where_the_request_matches_it(seed):
    """Random small-vocabulary texts: each global draft, with the match behind it, is text a response wrote."""
    rng = np.random.default_rng(seed)
    responses = [rng.integers(0, 6, size=int(rng.integers(5, 80))).tolist() for _ in range(30)]
    drafter = SamDrafter(VOCAB, DraftPolicy(max_global_tokens=1_000_000, min_match_length=1, global_margin=0))
    for i, response in enumerate(responses):
        _finish(drafter, f"done{i}", [900 + i % 50], response)
    drafter.add_request("live", [999])
    checked = 0
    for _ in range(200):
        token = int(rng.integers(0, 6))
        step = drafter.step(["live"], [[token]], 5)
        if step.sources != ["global"]:
            continue
        draft, match = step.tokens[0], step.match_lengths[0]
        text = drafter.response("live").tolist()
        assert 1 <= match <= 32 and draft
        assert _occurs(text[-match:] + draft, responses)
        checked += 1
    assert checked > 20


def test_an_earlier_rollouts_response_added_to_the_global_index_drafts_like_one_finished_here():
    earlier = _text(200, seed=5)
    seeded = SamDrafter(VOCAB, DraftPolicy(max_global_tokens=10_000, min_match_length=1))
    assert seeded.add_to_global(earlier)
    assert seeded.global_tokens == 200
    seeded.add_request("later", [4, 5, 6])
    step = seeded.step(["later"], [earlier[80:90]], 4)
    assert step.tokens == [earlier[90:94]] and step.sources == ["global"]
    assert not seeded.add_to_global([])  # nothing to index
    assert not seeded.add_to_global(list(range(VOCAB)) * 6)  # longer than a generation (half the bound)
    assert seeded.global_tokens == 200
    with pytest.raises(ValueError, match="outside the vocabulary"):
        seeded.add_to_global([VOCAB])
    off = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    assert not off.add_to_global(earlier) and off.global_tokens == 0
