"""vLLM's own model-free drafters under replay, driven the way vLLM 0.32 drives them.

- `NgramDrafter`: vLLM's prompt-lookup n-gram search (its numba function), with vLLM's
  defaults for method "ngram": prompt_lookup_min = prompt_lookup_max = 5
  (``vllm/config/speculative.py``). Stateless: it rescans the whole context every step.
- `SuffixDrafter`: SuffixDecoding, the arctic-inference ``SuffixDecodingCache`` that vLLM's
  ``SuffixDecodingProposer`` wraps, with vLLM's defaults: max_tree_depth 24,
  max_spec_factor 1.0, min_token_prob 0.1, max_cached_requests 10000 ("suffix-cache":
  finished responses feed a global tree) or 0 ("suffix": per-request tree only).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np

NGRAM_MIN = 5
NGRAM_MAX = 5
SUFFIX_MAX_TREE_DEPTH = 24
SUFFIX_MAX_CACHED_REQUESTS = 10_000
SUFFIX_MAX_SPEC_FACTOR = 1.0
SUFFIX_MIN_TOKEN_PROB = 0.1
_NO_LIMIT = 1 << 30  # max_model_len: replayed contexts never reach it


class NgramDrafter:
    """vLLM's n-gram proposer: longest n-gram (min..max) matching the suffix, k tokens after it."""

    name = "ngram"

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> None:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        self._search = _find_longest_matched_ngram_and_propose_tokens
        self.min_n, self.max_n = min_n, max_n
        self._search(np.arange(16, dtype=np.int32) % 4, min_n, max_n, _NO_LIMIT, 3)  # JIT-compile now, not timed

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Nothing to index: the search reads the context each step."""

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """Search every row's full context, as `NgramProposer.batch_propose` does."""
        return [self._search(c, self.min_n, self.max_n, _NO_LIMIT, k).tolist() for c in contexts]

    def remove(self, seq_id: int) -> None:
        """Nothing to free."""


def suffix_unavailable_reason() -> str | None:
    """Why SuffixDecoding cannot run here, or None when arctic-inference is importable."""
    if importlib.util.find_spec("arctic_inference") is None:
        return ("arctic-inference is not installed (vLLM's SuffixDecoding backend; install it with "
                "`pip install --no-deps --no-build-isolation arctic-inference==0.3.0` after nanobind)")
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError as error:
        return f"arctic-inference is installed but its suffix tree does not load: {error}"
    return None


class SuffixDrafter:
    """SuffixDecoding: per-request suffix tree over prompt + output, optionally a global tree of finished responses."""

    def __init__(self, global_cache: bool = True) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.name = "suffix-cache" if global_cache else "suffix"
        self.cache: Any = SuffixDecodingCache(
            max_tree_depth=SUFFIX_MAX_TREE_DEPTH,
            max_cached_requests=SUFFIX_MAX_CACHED_REQUESTS if global_cache else 0,
        )

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Build the request's prompt tree."""
        self.cache.start_request(seq_id, prompt)

    def step(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray],
             k: int) -> list[list[int]]:
        """Append accepted tokens, then speculate from the last max_tree_depth tokens."""
        drafts = []
        for seq_id, tokens, context in zip(seq_ids, new_tokens, contexts, strict=True):
            self.cache.add_active_response(seq_id, tokens)
            draft = self.cache.speculate(
                seq_id,
                context[-SUFFIX_MAX_TREE_DEPTH:],
                max_spec_tokens=k,
                max_spec_factor=SUFFIX_MAX_SPEC_FACTOR,
                min_token_prob=SUFFIX_MIN_TOKEN_PROB,
            )
            drafts.append(list(draft.token_ids))
        return drafts

    def remove(self, seq_id: int) -> None:
        """Finish the request (with the global cache on, its response joins the global tree)."""
        self.cache.stop_request(seq_id)
