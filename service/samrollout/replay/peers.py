"""vLLM's own model-free drafters under replay, driven the way vLLM 0.32 drives them.

- `NgramDrafter`: vLLM's prompt-lookup n-gram search (its numba function), with vLLM's
  defaults for method "ngram": prompt_lookup_min = prompt_lookup_max = 5
  (``SpeculativeConfig.__post_init__`` in ``vllm/config/speculative.py`` sets both to 5 when
  neither is given). Stateless: it rescans the whole context every step.
- `SuffixDrafter`: SuffixDecoding, the arctic-inference ``SuffixDecodingCache`` that vLLM's
  ``SuffixDecodingProposer`` (``vllm/v1/spec_decode/suffix_decoding.py``) wraps, with vLLM's
  ``SpeculativeConfig`` defaults: suffix_decoding_max_tree_depth 24,
  suffix_decoding_max_spec_factor 1.0, suffix_decoding_min_token_prob 0.1 and
  suffix_decoding_max_cached_requests 10000 ("suffix-cache": finished responses feed a global
  tree) or 0 ("suffix": vLLM's documented switch for "global tree off, prompt trees still used").
  Every one of these is a `SuffixSettings` field a user may set (the modes' ``--suffix-*`` options).

Both follow the replay protocol's shapes (`samrollout.replay.protocol.ReplayDrafter`): new tokens
arrive as lists (numpy arrays are accepted too) and drafts go back as lists of ints, at most k long.
One deliberate difference from vLLM: vLLM skips rows with no newly sampled tokens (partial
prefills); under replay the first step of a sequence has none but a complete prompt, so both
drafters draft from the prompt there, like every other replayed drafter.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NGRAM_MIN = 5
NGRAM_MAX = 5
SUFFIX_MAX_TREE_DEPTH = 24
SUFFIX_MAX_CACHED_REQUESTS = 10_000
SUFFIX_MAX_SPEC_FACTOR = 1.0
SUFFIX_MIN_TOKEN_PROB = 0.1
_NO_LIMIT = 1 << 30  # max_model_len: replayed contexts never reach it


@dataclass(frozen=True)
class SuffixSettings:
    """What a user of vLLM sets for method "suffix" (its ``speculative_config``); the defaults are vLLM 0.32's
    (``SpeculativeConfig``: depth 24, spec factor 1.0, min_token_prob 0.1, 10,000 cached requests; k, when
    not given, is the depth, as ``_validate_suffix_decoding`` sets it)."""

    depth: int = SUFFIX_MAX_TREE_DEPTH
    k: int | None = None  # num_speculative_tokens; None: the depth
    spec_factor: float = SUFFIX_MAX_SPEC_FACTOR
    min_token_prob: float = SUFFIX_MIN_TOKEN_PROB
    cached_requests: int = SUFFIX_MAX_CACHED_REQUESTS

    def __post_init__(self) -> None:
        if self.depth < 1 or (self.k is not None and self.k < 1) or self.spec_factor < 0 \
                or not 0 <= self.min_token_prob <= 1 or self.cached_requests < 0:
            raise ValueError(f"suffix settings out of vLLM's bounds (depth >= 1, k >= 1, spec factor >= 0, "
                             f"0 <= min_token_prob <= 1, cached requests >= 0): {self}")

    @property
    def num_speculative_tokens(self) -> int:
        """The k vLLM drafts up to: the one given, else the depth."""
        return self.depth if self.k is None else self.k

    def label(self) -> str:
        """A short name of the setting, e.g. ``d64-k32-f2-p0.1-c100000``."""
        return (f"d{self.depth}-k{self.num_speculative_tokens}-f{self.spec_factor:g}-p{self.min_token_prob:g}"
                f"-c{self.cached_requests}")

    def to_json(self) -> dict[str, float | int]:
        """The setting as vLLM's ``speculative_config`` keys (k resolved)."""
        return {"suffix_decoding_max_tree_depth": self.depth, "num_speculative_tokens": self.num_speculative_tokens,
                "suffix_decoding_max_spec_factor": self.spec_factor,
                "suffix_decoding_min_token_prob": self.min_token_prob,
                "suffix_decoding_max_cached_requests": self.cached_requests}


VLLM_SUFFIX = SuffixSettings()


def _int32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """One contiguous int32 row, the only layout numba's compiled search and arctic's zero-copy path take."""
    return np.ascontiguousarray(tokens, dtype=np.int32)


class NgramDrafter:
    """vLLM's n-gram proposer: longest n-gram (min..max) matching the suffix, then the k tokens after it."""

    name = "ngram"

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> None:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        self._search: Callable[[np.ndarray, int, int, int, int], np.ndarray] = (
            _find_longest_matched_ngram_and_propose_tokens
        )
        self.min_n, self.max_n = min_n, max_n
        # JIT-compile now (for the int32 rows `step` passes), so compile time is never timed.
        self._search(_int32(np.arange(16) % 4), min_n, max_n, _NO_LIMIT, 3)

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Nothing to index: the search reads the context each step."""

    def index(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]]) -> None:
        """Nothing to index (a round where the oracle using this source drafts nothing)."""

    def step(
        self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray], k: int
    ) -> list[list[int]]:
        """Search every row's full context, as `NgramProposer.batch_propose` does row by row."""
        if k <= 0:
            return [[] for _ in contexts]
        return [self._search(_int32(c), self.min_n, self.max_n, _NO_LIMIT, k).tolist() for c in contexts]

    def remove(self, seq_id: int) -> None:
        """Nothing to free."""


def suffix_unavailable_reason() -> str | None:
    """Why SuffixDecoding cannot run here, or None when arctic-inference's suffix tree loads."""
    if importlib.util.find_spec("arctic_inference") is None:
        return (
            "arctic-inference is not installed (vLLM's SuffixDecoding backend; it is sdist-only, install it with "
            "`pip install nanobind && pip install --no-deps --no-build-isolation arctic-inference==0.3.0`)"
        )
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError as error:
        return f"arctic-inference is installed but its suffix tree does not load: {error}"
    return None


class SuffixDrafter:
    """SuffixDecoding: a per-request suffix tree over prompt + output, optionally a global tree of finished ones."""

    def __init__(self, global_cache: bool = True, settings: SuffixSettings = VLLM_SUFFIX) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.name = "suffix-cache" if global_cache else "suffix"
        self.settings = settings
        self.cache: Any = SuffixDecodingCache(
            max_tree_depth=settings.depth,
            max_cached_requests=settings.cached_requests if global_cache else 0,
        )
        self._earlier = 0

    def add(self, seq_id: int, group_id: int, prompt: np.ndarray) -> None:
        """Build the request's prompt tree (a reused id's cached response is evicted first, as vLLM does)."""
        self.cache.start_request(seq_id, _int32(prompt))

    def remember(self, group_id: int, prompt: np.ndarray, responses: Sequence[np.ndarray]) -> None:
        """An earlier rollout's responses pass through as finished requests (kept by the global cache only)."""
        for response in responses:
            self._earlier -= 1  # ids of their own, below the replay's (which count up from 0)
            self.cache.start_request(self._earlier, _int32(prompt))
            self.cache.add_active_response(self._earlier, _int32(response))
            self.cache.stop_request(self._earlier)

    def index(self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]]) -> None:
        """Append accepted tokens without speculating (a round where the oracle using this source drafts nothing)."""
        for seq_id, tokens in zip(seq_ids, new_tokens, strict=True):
            if len(tokens):
                self.cache.add_active_response(seq_id, _int32(tokens) if isinstance(tokens, np.ndarray) else tokens)

    def step(
        self, seq_ids: Sequence[int], new_tokens: Sequence[list[int]], contexts: Sequence[np.ndarray], k: int
    ) -> list[list[int]]:
        """Append accepted tokens, then speculate from the last max_tree_depth tokens, as vLLM's proposer does."""
        drafts: list[list[int]] = []
        for seq_id, tokens, context in zip(seq_ids, new_tokens, contexts, strict=True):
            if len(tokens):
                self.cache.add_active_response(seq_id, _int32(tokens) if isinstance(tokens, np.ndarray) else tokens)
            if k <= 0:  # arctic reads max_spec_tokens=0 as "up to max_tree_depth"
                drafts.append([])
                continue
            draft = self.cache.speculate(
                seq_id,
                _int32(context[-self.settings.depth:]),
                max_spec_tokens=k,
                max_spec_factor=self.settings.spec_factor,
                min_token_prob=self.settings.min_token_prob,
            )
            drafts.append(list(draft.token_ids)[:k])
        return drafts

    def remove(self, seq_id: int) -> None:
        """Finish the request (with the global cache on, its response stays in the global tree)."""
        self.cache.stop_request(seq_id)


def add_suffix_flags(parser: Any) -> None:
    """The ``--suffix-*`` options of a mode (replay, simulate, simulate-rl): vLLM's `suffix` settings, its
    defaults unless given (`SuffixSettings`)."""
    group = parser.add_argument_group("vLLM suffix (SuffixDecoding) settings, vLLM 0.32's defaults unless given")
    group.add_argument("--suffix-depth", type=int, default=SUFFIX_MAX_TREE_DEPTH,
                       help="suffix_decoding_max_tree_depth (default %(default)s)")
    group.add_argument("--suffix-k", type=int, default=None,
                       help="num_speculative_tokens for suffix (default: the depth, as vLLM sets it)")
    group.add_argument("--suffix-spec-factor", type=float, default=SUFFIX_MAX_SPEC_FACTOR,
                       help="suffix_decoding_max_spec_factor (default %(default)s)")
    group.add_argument("--suffix-min-token-prob", type=float, default=SUFFIX_MIN_TOKEN_PROB,
                       help="suffix_decoding_min_token_prob (default %(default)s)")
    group.add_argument("--suffix-cached-requests", type=int, default=SUFFIX_MAX_CACHED_REQUESTS,
                       help="suffix_decoding_max_cached_requests of the global tree (default %(default)s)")


def suffix_from_args(args: Any) -> SuffixSettings:
    """The `SuffixSettings` the ``--suffix-*`` options name (ValueError out of vLLM's bounds)."""
    return SuffixSettings(depth=args.suffix_depth, k=args.suffix_k, spec_factor=args.suffix_spec_factor,
                          min_token_prob=args.suffix_min_token_prob, cached_requests=args.suffix_cached_requests)
