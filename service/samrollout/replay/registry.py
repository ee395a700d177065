"""Drafters the replay command knows by name, the oracle's sources, and how each drafts by default.

"As the engine would" (the replay's default) means:

- ours (``sam``, ``sam-group``, ``sam-ref``) and the oracle: the static mode's k (3) and its
  threshold: in a round with more than ``threshold`` (8) running rows only rows whose
  match is at least ``confident_match`` (8) tokens draft (samrollout's vLLM proposer,
  `samrollout.spec_decode.proposer.SamProposer`, still indexes every row's tokens); the draft
  policy with ``min_match_length="auto"`` settled as on GPUs and NPUs
  (1).  The replay follows the static mode: the adaptive policy (the engine's default) chooses drafts
  from step times, which a replay has not got; `samrollout simulate` projects it.
- vLLM's peers at vLLM's defaults, which have no batch-size threshold (they draft in every
  round): ``suffix`` / ``suffix-cache`` with vLLM's default k for method "suffix",
  ``suffix_decoding_max_tree_depth`` (24; the draft is further capped by the match length);
  ``ngram`` has no default k in vLLM (``num_speculative_tokens`` is required), so it gets
  the engine's k (3).

``--k`` forces one k for every drafter and the oracle; ``--threshold`` changes or removes our gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from samrollout.config import SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.replay.drafters import SamGoodputReplayDrafter, SamRefDrafter, SamReplayDrafter
from samrollout.replay.peers import SuffixSettings
from samrollout.replay.protocol import ReplayDrafter

DEFAULT_DRAFTERS = ("sam", "sam-group", "sam-ref", "ngram", "suffix", "suffix-cache")
# Ours: these follow the engine's static threshold (the published design, sam-ref, included).
OURS = ("sam", "sam-group", "sam-history", "sam-global", "sam-ref")
# Ours as the adaptive policy chooses, at a flat step cost (every round; the replay has no step times):
# the policy as the flags give it, and with the counted proposals.
ADAPTIVE = ("sam-adaptive", "sam-counted")
ORACLE = "oracle"
# The oracle's own sources: the request's own automaton and its group's (the two a sam-group row picks from).
OWN_SOURCES = ("own", "group")
DEFAULT_ORACLE_SOURCES = OWN_SOURCES
VLLM_SUFFIX_DEFAULT_K = 24  # vLLM: num_speculative_tokens defaults to suffix_decoding_max_tree_depth for "suffix"
ENGINE = SpeculationConfig(threshold_mode="static")  # the replay has no step times for the adaptive policy
# sam-history keeps this many tokens of earlier responses (the engine's default, when off there: 2**24).
REPLAY_HISTORY_TOKENS = ENGINE.history_tokens or 1 << 24
# sam-global's global index of finished responses: the engine's bound, or this when it is off there.
REPLAY_GLOBAL_TOKENS = ENGINE.policy.max_global_tokens or 1 << 22


def engine_k(name: str) -> int:
    """The k the engine (ours) or vLLM (peers) uses for this drafter when none is given."""
    if name in ("suffix", "suffix-cache"):
        return VLLM_SUFFIX_DEFAULT_K
    return ENGINE.k


def engine_threshold(name: str) -> int | None:
    """Most running rows at which this drafter drafts by default (None: every round)."""
    if name in OURS or name == ORACLE:
        return ENGINE.threshold if ENGINE.threshold_mode != "off" else None
    return None


def make_drafter(name: str, vocab_size: int, policy: DraftPolicy | None = None,
                 confident_match: int = ENGINE.confident_match, suffix: SuffixSettings | None = None) -> ReplayDrafter:
    """Build a drafter by name; raises ValueError for unknown names, RuntimeError if unavailable here.
    ``confident_match``: our drafters' `SpeculationConfig.confident_match` (past the threshold); ``suffix``:
    the `suffix` drafters' settings (default: vLLM's)."""
    if name == ORACLE:
        raise ValueError("the oracle is not a drafter: it is reported on its own (see --oracle-sources)")
    if name == "sam":
        return SamReplayDrafter("sam", vocab_size, policy, confident_match=confident_match)
    if name == "sam-group":
        return SamReplayDrafter("sam-group", vocab_size, policy, group=True, confident_match=confident_match)
    if name == "sam-history":
        return SamReplayDrafter("sam-history", vocab_size, policy, group=True, history_tokens=REPLAY_HISTORY_TOKENS,
                                confident_match=confident_match)
    if name == "sam-global":
        policy = policy or DraftPolicy()
        if not policy.max_global_tokens:
            policy = replace(policy, max_global_tokens=REPLAY_GLOBAL_TOKENS)
        return SamReplayDrafter("sam-global", vocab_size, policy, group=True, history_tokens=REPLAY_HISTORY_TOKENS,
                                confident_match=confident_match)
    if name == "sam-ref":
        return SamRefDrafter()
    if name == "sam-adaptive":
        return SamGoodputReplayDrafter(name, vocab_size, policy)
    if name == "sam-counted":
        return SamGoodputReplayDrafter(name, vocab_size, replace(policy or DraftPolicy(), proposals="counted"))
    if name == "ngram":
        from samrollout.replay.peers import NgramDrafter

        return NgramDrafter()
    if name in ("suffix", "suffix-cache"):
        from samrollout.replay.peers import SuffixDrafter, suffix_unavailable_reason

        reason = suffix_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"{name}: {reason}")
        return SuffixDrafter(global_cache=name == "suffix-cache", settings=suffix or SuffixSettings())
    known = ", ".join([*DEFAULT_DRAFTERS, "sam-history", "sam-global", *ADAPTIVE])
    raise ValueError(f"unknown drafter {name!r}; known: {known}")


def make_source(name: str, vocab_size: int, policy: DraftPolicy | None = None) -> ReplayDrafter:
    """One oracle source: "own" (the request's automaton), "group" (its group's), or a drafter by name."""
    policy = (policy or DraftPolicy()).for_hardware(on_cpu=False)
    if name == "own":
        return SamReplayDrafter("own", vocab_size, replace(policy, source="own"))
    if name == "group":
        return SamReplayDrafter("group", vocab_size, replace(policy, source="group"), group=True)
    return make_drafter(name, vocab_size, policy)


def factory(name: str, vocab_size: int, policy: DraftPolicy | None = None,
            confident_match: int = ENGINE.confident_match,
            suffix: SuffixSettings | None = None) -> Callable[[], ReplayDrafter]:
    """A zero-argument constructor (fresh state per measurement)."""
    return lambda: make_drafter(name, vocab_size, policy, confident_match, suffix)
