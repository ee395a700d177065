"""The source-selection oracle: per step, the best draft any of its sources gave.

Not a drafter (nothing in an engine can run it): it steps every source in lockstep on one
trajectory, and the replay's verifier, which knows the recorded continuation, takes the
candidate with the longest accepted prefix (`samrollout.replay.simulate`).  Its MAL is the
ceiling of choosing between those sources per step; by default the sources are a request's
own automaton and its group's, the two a ``sam-group`` row chooses between, so at every
step it accepts at least what ``sam`` and ``sam-group`` would from the same position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from samrollout.replay.protocol import ReplayDrafter, remember


class SourceOracle:
    """Candidates from several sources per row; the verifier picks (see the module docstring)."""

    def __init__(self, sources: Sequence[tuple[str, ReplayDrafter]]) -> None:
        if not sources:
            raise ValueError("the oracle needs at least one source")
        self.sources = [name for name, _ in sources]
        self.name = f"oracle({'+'.join(self.sources)})"
        self._drafters = [drafter for _, drafter in sources]

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Start the sequence in every source."""
        for drafter in self._drafters:
            drafter.add(seq_id, group_id, prompt)

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[list[int]]]:
        """Per row, one candidate draft per source (in source order)."""
        per_source = [drafter.step(seq_ids, new_tokens, contexts, k) for drafter in self._drafters]
        return [list(row) for row in zip(*per_source, strict=True)]

    def index(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
              k: int) -> None:
        """A round where the oracle drafts nothing: sources take the new tokens; those with an ``index``
        method (vLLM's peers) skip proposing, ours step as the engine's proposer does in such a round."""
        for drafter in self._drafters:
            index = getattr(drafter, "index", None)
            if index is not None:
                index(seq_ids, new_tokens)
            else:
                drafter.step(seq_ids, new_tokens, contexts, k)

    def remember(self, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
        """An earlier rollout's responses, to every source that keeps them."""
        for drafter in self._drafters:
            remember(drafter, group_id, prompt, responses)

    def remove(self, seq_id: int) -> None:
        """Finish the sequence in every source."""
        for drafter in self._drafters:
            drafter.remove(seq_id)
