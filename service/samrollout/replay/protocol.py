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

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[np.ndarray], contexts: Sequence[np.ndarray],
             k: int) -> list[np.ndarray]:
        """Append each row's accepted tokens (bonus included), then draft up to k tokens per row."""
        ...

    def remove(self, seq_id: int) -> None:
        """The sequence finished."""
        ...
