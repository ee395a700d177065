"""Drafters the replay command knows by name."""

from __future__ import annotations

from collections.abc import Callable

from samrollout.drafter import DraftPolicy
from samrollout.replay.drafters import SamRefDrafter, SamReplayDrafter
from samrollout.replay.protocol import ReplayDrafter

DEFAULT_DRAFTERS = ("sam", "sam-group", "sam-ref", "ngram", "suffix", "suffix-cache")


def make_drafter(name: str, vocab_size: int, policy: DraftPolicy | None = None) -> ReplayDrafter:
    """Build a drafter by name; raises ValueError for unknown names, RuntimeError if unavailable here."""
    if name == "sam":
        return SamReplayDrafter("sam", vocab_size, policy)
    if name == "sam-group":
        return SamReplayDrafter("sam-group", vocab_size, policy, group=True)
    if name == "sam-ref":
        return SamRefDrafter()
    if name == "ngram":
        from samrollout.replay.peers import NgramDrafter

        return NgramDrafter()
    if name in ("suffix", "suffix-cache"):
        from samrollout.replay.peers import SuffixDrafter, suffix_unavailable_reason

        reason = suffix_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"{name}: {reason}")
        return SuffixDrafter(global_cache=name == "suffix-cache")
    raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DEFAULT_DRAFTERS)}")


def factory(name: str, vocab_size: int, policy: DraftPolicy | None = None) -> Callable[[], ReplayDrafter]:
    """A zero-argument constructor (fresh state per measurement)."""
    return lambda: make_drafter(name, vocab_size, policy)
