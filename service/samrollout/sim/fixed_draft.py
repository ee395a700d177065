"""A vLLM proposer for cost measurement only: every row gets the full draft, so every step verifies q tokens per row.

    speculative_config={"method": "custom_class", "model": "samrollout.sim.fixed_draft.FixedDraftProposer",
                        "num_speculative_tokens": q - 1}

Each row that sampled a token in the step gets ``num_speculative_tokens`` copies of one token that is not
the one it just sampled (the next id), so a greedy target model rejects the drafts (almost always): rows
advance one token a step, as without speculation, while the step still runs q positions per row
(`bench/engine_cost.py`).  A draft never passes ``max_model_len``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class FixedDraftProposer:
    """vLLM custom_class proposer: a full-length draft for every row that sampled a token."""

    def __init__(self, vllm_config: Any, runner: Any | None = None) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """k tokens per row that sampled one (none for partial prefills), cut where max_model_len would pass."""
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            room = min(self.k, self.max_model_len - int(num_tokens_no_spec[row]) - 1)
            drafts.append([(sampled[-1] + 1) % self.vocab_size] * room if sampled and room > 0 else [])
        return drafts
