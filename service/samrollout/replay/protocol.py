"""The interface every drafter implements under replay."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class ReplayDrafter(Protocol):
    """A drafter under replay: rows are sequences (prompt + response so far)."""

    name: str

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Start a sequence; siblings of one prompt share ``group_id``."""
        ...

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """Append each row's accepted tokens (bonus included; lists, as engines pass them), then draft
        up to k tokens per row. ``contexts[i]`` is the row's whole sequence so far (new tokens included)."""
        ...

    def remove(self, seq_id: int) -> None:
        """The sequence finished."""
        ...


def remember(drafter: object, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
    """Give ``drafter`` an earlier rollout's finished responses to this prompt, if it keeps any across
    rollouts (an optional ``remember`` method: sam-history, suffix-cache's global tree); others ignore them."""
    method = getattr(drafter, "remember", None)
    if method is not None and len(responses):
        method(group_id, prompt, responses)
