"""vLLM's peers under replay propose what their algorithms say, in the replay's shapes."""

from __future__ import annotations

import numpy as np
import pytest

from samrollout.replay.peers import NGRAM_MAX, NGRAM_MIN, NgramDrafter, SuffixDrafter, suffix_unavailable_reason

PERIOD = [7, 8, 9, 10, 11, 12]
SHORT = np.asarray([1, 2, 3, 4, 1, 2, 3], dtype=np.int32)  # only a 3-gram repeats

needs_suffix = pytest.mark.skipif(suffix_unavailable_reason() is not None, reason=str(suffix_unavailable_reason()))


def _context(repeats: int) -> np.ndarray:
    return np.asarray(PERIOD * repeats + PERIOD[:2], dtype=np.int32)


def _assert_shapes(drafts: list[list[int]], rows: int, k: int) -> None:
    assert isinstance(drafts, list) and len(drafts) == rows
    for draft in drafts:
        assert isinstance(draft, list) and len(draft) <= k
        assert all(type(token) is int for token in draft)


def test_ngram_uses_vllm_defaults():
    assert (NGRAM_MIN, NGRAM_MAX) == (5, 5)


def test_ngram_proposes_the_tokens_after_the_matching_five_gram():
    drafter = NgramDrafter()
    context = _context(3)
    drafts = drafter.step([0], [[int(context[-1])]], [context], 3)
    assert drafts == [[9, 10, 11]]
    _assert_shapes(drafts, 1, 3)


def test_ngram_proposes_nothing_without_a_five_token_match():
    drafter = NgramDrafter()
    assert drafter.step([0], [[3]], [SHORT], 3) == [[]]


def test_ngram_with_shorter_ngrams_continues_the_repeated_three_gram():
    drafter = NgramDrafter(min_n=1, max_n=3)
    assert drafter.step([0], [[3]], [SHORT], 3) == [[4, 1, 2]]
    assert drafter.step([0], [[3]], [SHORT], 2) == [[4, 1]]


@pytest.mark.parametrize("k", [0, 1, 4, 10])
def test_ngram_returns_at_most_k_tokens_for_every_row(k):
    drafter = NgramDrafter()
    contexts = [_context(5), SHORT, np.asarray([], dtype=np.int32), _context(2).astype(np.int64)]
    drafts = drafter.step([0, 1, 2, 3], [[], [], [], np.asarray([8])], contexts, k)
    _assert_shapes(drafts, 4, k)
    assert drafts[0] == [9, 10, 11, 12, 7, 8, 9, 10, 11, 12][:k]
    assert drafts[1] == drafts[2] == []


def test_ngram_first_step_drafts_from_the_prompt():
    drafter = NgramDrafter()
    context = _context(2)
    drafter.add(0, 0, context)
    assert drafter.step([0], [[]], [context], 2) == [[9, 10]]
    drafter.remove(0)


@needs_suffix
@pytest.mark.parametrize("global_cache", [False, True])
def test_suffix_decoding_continues_a_repeated_pattern_within_k(global_cache):
    drafter = SuffixDrafter(global_cache=global_cache)
    assert drafter.name == ("suffix-cache" if global_cache else "suffix")
    context = _context(4)
    drafter.add(0, 0, context[:-1])
    drafts = drafter.step([0], [[int(context[-1])]], [context], 3)
    assert drafts == [[9, 10, 11]]
    _assert_shapes(drafts, 1, 3)
    assert drafter.step([0], [[]], [context], 2)[0] == [9, 10]
    assert drafter.step([0], [[]], [context], 0) == [[]]
    drafter.remove(0)


@needs_suffix
@pytest.mark.parametrize("global_cache", [False, True])
def test_suffix_decoding_spec_length_is_capped_by_the_match_length(global_cache):
    drafter = SuffixDrafter(global_cache=global_cache)
    drafter.add(0, 0, SHORT[:4])
    # The matched suffix is [1, 2, 3]; max_spec_factor 1.0 allows at most 3 draft tokens even at k = 5.
    assert drafter.step([0], [[1, 2, 3]], [SHORT], 5) == [[4, 1, 2]]
    assert drafter.step([0], [[]], [SHORT], 2) == [[4, 1]]


@needs_suffix
def test_suffix_first_step_drafts_from_the_prompt_and_accepts_numpy_rows():
    drafter = SuffixDrafter(global_cache=False)
    prompt = _context(3).astype(np.int64)
    drafter.add(0, 0, prompt)
    assert drafter.step([0], [np.asarray([], dtype=np.int64)], [prompt], 4) == [[9, 10, 11, 12]]
    grown = np.concatenate([prompt, [9, 10]])
    drafts = drafter.step([0], [np.asarray([9, 10], dtype=np.int64)], [grown], 20)
    _assert_shapes(drafts, 1, 20)
    assert drafts[0][:4] == [11, 12, 7, 8]


@needs_suffix
def test_suffix_global_cache_drafts_from_a_finished_response_of_another_request():
    cached, alone = SuffixDrafter(global_cache=True), SuffixDrafter(global_cache=False)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    for drafter in (cached, alone):
        drafter.add(0, 0, np.asarray([1, 2], dtype=np.int32))
        drafter.step([0], [answer], [np.asarray([1, 2, *answer], dtype=np.int32)], 3)
        drafter.remove(0)
        drafter.add(1, 1, np.asarray([3], dtype=np.int32))
    context = np.asarray([3, 40, 41, 42], dtype=np.int32)
    assert cached.step([1], [[40, 41, 42]], [context], 3) == [[43, 44, 45]]
    assert alone.step([1], [[40, 41, 42]], [context], 3) == [[]]


@needs_suffix
def test_suffix_index_takes_tokens_like_step_without_proposing():
    stepped, indexed = SuffixDrafter(global_cache=True), SuffixDrafter(global_cache=True)
    context = _context(4)
    for drafter in (stepped, indexed):
        drafter.add(0, 0, context[:3])
    stepped.step([0], [context[3:-1].tolist()], [context[:-1]], 3)
    indexed.index([0], [context[3:-1].tolist()])
    last = [[int(context[-1])]]
    assert stepped.step([0], last, [context], 3) == indexed.step([0], last, [context], 3)
