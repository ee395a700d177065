"""Brute-force reference for drafting: quadratic scans that are obviously right."""

from __future__ import annotations

from collections.abc import Sequence


def own_occurrences(seq: Sequence[int]) -> tuple[int, list[int]]:
    """Longest suffix of ``seq`` that also ends earlier, and every earlier end position."""
    n = len(seq)
    for length in range(n - 1, 0, -1):
        suffix = list(seq[n - length:])
        ends = [e for e in range(length - 1, n - 1) if list(seq[e - length + 1: e + 1]) == suffix]
        if ends:
            return length, ends
    return 0, []


def group_occurrences(prompt: Sequence[int], responses: Sequence[Sequence[int]],
                      member: int) -> tuple[int, list[tuple[list[int], int]]]:
    """Longest suffix of member's prompt+response that ends anywhere else in the group.

    Returns the length and the occurrences as (string, end position) pairs; positions
    inside the shared prompt count once (they belong to the prompt, not to a member).
    """
    strings = [list(prompt) + list(r) for r in responses]
    me = strings[member]
    n = len(me)
    candidates: list[tuple[list[int], int]] = [(list(prompt), e) for e in range(len(prompt))]
    for j, s in enumerate(strings):
        candidates += [(s, e) for e in range(len(prompt), len(s)) if not (j == member and e == n - 1)]
    if not responses[member]:
        candidates = [(s, e) for s, e in candidates if not (s == list(prompt) and e == n - 1)]
    for length in range(n, 0, -1):
        suffix = me[n - length:]
        found = [(s, e) for s, e in candidates if e >= length - 1 and s[e - length + 1: e + 1] == suffix]
        if found:
            return length, found
    return 0, []


def expected_length(match: int, k: int, min_match: int, scale: float) -> int:
    """Draft length the policy allows for a match of length ``match``."""
    if match < min_match:
        return 0
    return k if scale <= 0 else min(k, max(1, int(scale * match)))


def own_continuation(seq: Sequence[int], end: int, count: int) -> list[int]:
    """``count`` tokens after position ``end`` of ``seq``, continued periodically past its end.

    The occurrence ending at ``end`` matches the suffix of ``seq``, so what followed it is
    predicted to follow again: the draft repeats with period len(seq) - 1 - end.
    """
    draft: list[int] = []
    for i in range(count):
        j = end + 1 + i
        draft.append(seq[j] if j < len(seq) else draft[j - len(seq)])
    return draft
