"""vLLM's peers under replay propose what their algorithms say, in the replay's shapes."""

from __future__ import annotations

import numpy as np
import pytest

from samrollout.replay.peers import NgramDrafter, SuffixDrafter, suffix_unavailable_reason

PERIOD = [7, 8, 9, 10, 11, 12]


def _context(repeats: int) -> np.ndarray:
    return np.asarray(PERIOD * repeats + PERIOD[:2], dtype=np.int32)


def test_ngram_proposes_the_tokens_after_the_matching_five_gram():
    drafter = NgramDrafter()
    context = _context(3)
    drafts = drafter.step([0], [[int(context[-1])]], [context], 3)
    assert drafts == [[9, 10, 11]]


def test_ngram_proposes_nothing_without_a_five_token_match():
    drafter = NgramDrafter()
    context = np.asarray([1, 2, 3, 4, 1, 2, 3], dtype=np.int32)  # only a 3-gram repeats
    assert drafter.step([0], [[3]], [context], 3) == [[]]


@pytest.mark.skipif(suffix_unavailable_reason() is not None, reason=str(suffix_unavailable_reason()))
@pytest.mark.parametrize("global_cache", [False, True])
def test_suffix_decoding_continues_a_repeated_pattern_within_k(global_cache):
    drafter = SuffixDrafter(global_cache=global_cache)
    context = _context(4)
    drafter.add(0, 0, context[:-1])
    drafts = drafter.step([0], [[int(context[-1])]], [context], 3)
    assert drafts == [[9, 10, 11]]
    assert drafter.step([0], [[]], [context], 2)[0] == [9, 10]
    drafter.remove(0)


@pytest.mark.skipif(suffix_unavailable_reason() is not None, reason=str(suffix_unavailable_reason()))
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
