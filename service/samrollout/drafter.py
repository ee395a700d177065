"""The SAM drafter: many concurrent requests, optional GRPO groups, one call per step.

`SamDrafter` wraps the native core (``service/csrc``).  Requests are keyed by any
hashable id (vLLM's request ids are strings); groups likewise.  The wrapper keeps
only the id-to-handle maps: every per-token loop runs in C++ with the GIL released.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from samrollout._core import MAX_DRAFT_TOKENS, core
from samrollout.tokens import Int32Array, as_token_array

Occurrence = Literal["first", "recent", "frequent"]
Source = Literal["own", "group", "both"]
_OCCURRENCES: tuple[Occurrence, ...] = ("first", "recent", "frequent")
_SOURCES: tuple[Source, ...] = ("own", "group", "both")
DraftSourceName = Literal["own", "group", "global"]
# Where a draft comes from, in the native core's order (DraftSource in service/csrc/drafter.hpp).
DRAFT_SOURCES: tuple[DraftSourceName, ...] = ("own", "group", "global")
# What min_match_length="auto" becomes (see DraftPolicy): verifying drafts is compute-bound on CPUs.
CPU_MIN_MATCH_LENGTH = 2
ACCELERATOR_MIN_MATCH_LENGTH = 1


@dataclass(frozen=True)
class DraftPolicy:
    """How drafts are chosen; defaults measured with ``bench/tune_policy.py`` on the bundled traces.

    - ``occurrence``: which earlier occurrence of the matched suffix supplies the draft.
      "recent" (the latest occurrence at which that suffix was the longest match) beat
      "first" on the traces: reasoning loops repeat their latest variant.  "frequent" follows
      no single occurrence: token by token it drafts what most often followed the context
      (the longest match, then the match grown by the drafted tokens; occurrence counts per
      automaton state, kept along at most 256 suffix links per token), so a sibling that
      strayed does not lead the others' drafts.  Measured on real reasoning traces at k=16
      (README, "Frequent continuations"), it ties "recent": +1.8% tail MAL on R1-distill,
      -1.3% on Sky-T1; not the default.
    - ``min_probability`` ("frequent" only): a draft stops where the estimated probability
      that all of it is accepted (the product of each token's share of its context's
      continuations) falls below this; 0 (default) drafts up to k.  A context seen once has
      probability 1, so this cuts drafts where siblings disagree, not where evidence is thin.
    - ``min_match_length``: matches shorter than this propose nothing.  1 drafts most and
      has the highest MAL (2.22 on the bundled traces); 2 trades a little MAL (2.06) for a
      higher acceptance rate (0.56 vs 0.46), which pays where verifying a rejected draft
      costs real compute.  "auto" (default) picks by the hardware the engine runs on, from
      ``bench/results/verify-cost-*.json``: 2 on CPU (3 drafts cost 1.5-2x a plain step;
      measured in the engine with its worker on one core: rollout makespan -9% against 1;
      with both cores 1 and 2 tie, 14.85 s against 14.99 s in one round), 1 on GPUs and NPUs (3 drafts
      cost about 1.05x; projected 2.08x against 1.97x for 2).  Outside an engine (replay,
      a bare `SamDrafter`) "auto" means 1.
    - ``match_scale``: when > 0, a match of length L drafts at most max(1, floor(scale * L))
      tokens (still capped by k); 0 (measured best for MAL) drafts the full k whenever the
      match is long enough.
    - ``source``: for a request in a group, draft from its own automaton, the group's, or
      both: the group's match wins only when longer than the request's own by more than
      ``group_margin`` tokens (4 measured best in the tail: a request in a loop predicts
      itself better than a sibling with a slightly longer match does).
    - ``max_request_tokens`` / ``max_group_tokens``: hard bounds on indexed tokens; past
      them the automaton is freed and that source proposes nothing (graceful fallback).
    - ``max_global_tokens``: a global index of finished responses to every prompt (like
      SuffixDecoding's global cache), bounded to this many tokens in two generations (the
      newest responses are kept; about 150 bytes per token); 0 (default) turns it off.  A
      running request is looked up by its last 32 tokens, only where its own and group
      match is short; the global draft wins when its match is longer than theirs by more
      than ``global_margin`` (4 measured best of 0/4/16/31).  Off by default because it
      gained under 1% of tail MAL on real reasoning traces (`bench/results/replay-global-*`):
      the group and the cross-epoch history already hold the text that predicts a response.
    """

    occurrence: Occurrence = "recent"
    min_match_length: int | Literal["auto"] = "auto"
    match_scale: float = 0.0
    source: Source = "both"
    group_margin: int = 4
    max_request_tokens: int = 1 << 22
    max_group_tokens: int = 1 << 24
    max_global_tokens: int = 0
    global_margin: int = 4
    min_probability: float = 0.0

    def __post_init__(self) -> None:
        if self.occurrence not in _OCCURRENCES:
            raise ValueError(f"occurrence must be one of {_OCCURRENCES}, got {self.occurrence!r}")
        if self.source not in _SOURCES:
            raise ValueError(f"source must be one of {_SOURCES}, got {self.source!r}")
        if self.min_match_length != "auto":
            check_int("min_match_length", self.min_match_length, 1, 1 << 30)
        check_int("group_margin", self.group_margin, 0, 1 << 30)
        if isinstance(self.match_scale, bool) or not isinstance(self.match_scale, (int, float, np.number)) \
                or not np.isfinite(self.match_scale) or self.match_scale < 0:
            raise ValueError(f"match_scale must be a finite number >= 0, got {self.match_scale!r}")
        check_int("max_request_tokens", self.max_request_tokens, 1, 1 << 30)
        check_int("max_group_tokens", self.max_group_tokens, 1, 1 << 30)
        check_int("max_global_tokens", self.max_global_tokens, 0, 1 << 30)
        check_int("global_margin", self.global_margin, 0, 1 << 30)
        if isinstance(self.min_probability, bool) \
                or not isinstance(self.min_probability, (int, float, np.number)) \
                or not 0.0 <= float(self.min_probability) <= 1.0:
            raise ValueError(f"min_probability must be a number in [0, 1], got {self.min_probability!r}")

    def as_dict(self) -> dict[str, Any]:
        """The policy as plain data (for JSON reports and configs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DraftPolicy:
        """A policy from plain data (`as_dict`, a config file, a flag); unknown fields raise ValueError."""
        known = [field.name for field in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown draft policy fields {unknown}; known: {known}")
        return cls(**values)

    def for_hardware(self, on_cpu: bool) -> DraftPolicy:
        """This policy with "auto" settled for the hardware that verifies the drafts."""
        if self.min_match_length != "auto":
            return self
        return replace(self, min_match_length=CPU_MIN_MATCH_LENGTH if on_cpu else ACCELERATOR_MIN_MATCH_LENGTH)


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """Raise ValueError unless ``value`` is an integer (not a bool or float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer between {low} and {high}, got {value!r}")


class SamDrafter:
    """Suffix-automaton drafts for a changing set of requests.

    Lifecycle: `add_request` (prompt, optional group) -> `append` / `step` as tokens are
    accepted -> `propose` -> `remove_request` (frees the request; the last sibling to
    leave frees its group's automaton).  Not a per-request object on purpose: one engine
    step is one `step_arrays` call for the whole batch.
    """

    def __init__(self, vocab_size: int, policy: DraftPolicy | None = None) -> None:
        self.policy = (policy or DraftPolicy()).for_hardware(on_cpu=False)
        if isinstance(vocab_size, bool) or int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = int(vocab_size)
        self._core = core.Core(
            vocab_size=self.vocab_size,
            min_match_length=int(self.policy.min_match_length),
            match_scale=float(self.policy.match_scale),
            occurrence=_OCCURRENCES.index(self.policy.occurrence),
            source=_SOURCES.index(self.policy.source),
            group_margin=int(self.policy.group_margin),
            max_request_tokens=int(self.policy.max_request_tokens),
            max_group_tokens=int(self.policy.max_group_tokens),
            max_global_tokens=int(self.policy.max_global_tokens),
            global_margin=int(self.policy.global_margin),
            min_probability=float(self.policy.min_probability),
        )
        self._handles: dict[Hashable, int] = {}
        self._request_group: dict[int, Hashable] = {}
        self._groups: dict[Hashable, tuple[int, int]] = {}  # group id -> (handle, members)
        self._next_handle = 0

    # -- lifecycle -----------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt: Sequence[int] | npt.NDArray[Any],
                    group: Hashable | None = None) -> bool:
        """Start indexing a request's prompt; siblings pass the same ``group`` (and prompt).

        A request whose prompt starts with the group's prompt joins the group: a sibling, or a
        sibling continued from its generated tokens (the client's divided rollout), whose extra
        tokens count as its response so far.  Any other prompt drafts alone.  Returns whether
        the request joined ``group``.
        """
        if request_id in self._handles:
            raise ValueError(f"request {request_id!r} is already active")
        prompt_array = as_token_array(prompt, "prompt")
        handle = self._new_handle()
        group_handle = -1
        if group is not None:
            group_handle, members = self._groups.get(group, (self._new_handle(), 0))
        joined = bool(self._core.add_request(handle, prompt_array, group_handle))
        self._handles[request_id] = handle
        if group is not None and joined:
            self._groups[group] = (group_handle, members + 1)
            self._request_group[handle] = group
        return joined

    def remove_request(self, request_id: Hashable) -> None:
        """Forget a finished or aborted request and free its memory."""
        handle = self._handle(request_id)
        self._core.remove_request(handle)
        del self._handles[request_id]
        group = self._request_group.pop(handle, None)
        if group is not None:
            group_handle, members = self._groups[group]
            if members == 1:
                del self._groups[group]
            else:
                self._groups[group] = (group_handle, members - 1)

    def add_to_group(self, group: Hashable, response: Sequence[int] | npt.NDArray[Any]) -> bool:
        """Index a finished response to the live ``group``'s prompt (from an earlier rollout) as one more
        string siblings draft from.  False (nothing indexed) when it would exceed ``max_group_tokens``."""
        if group not in self._groups:
            raise KeyError(f"unknown group {group!r}: history joins a group while it has a live member")
        return bool(self._core.add_to_group(self._groups[group][0], as_token_array(response, "response")))

    def add_to_global(self, response: Sequence[int] | npt.NDArray[Any]) -> bool:
        """Index a finished response (an earlier rollout's, to any prompt) into the global index, as a
        request that wrote it would be on finishing here.  False (nothing indexed) when the index is off
        (``max_global_tokens`` 0), or the response is empty or longer than half that bound."""
        return bool(self._core.add_to_global(as_token_array(response, "response")))

    def response(self, request_id: Hashable) -> Int32Array:
        """The request's response so far, as indexed (empty when its automata overflowed)."""
        tokens: Int32Array = self._core.response(self._handle(request_id))
        return tokens

    def last_sources(self, request_ids: Sequence[Hashable]) -> list[DraftSourceName | None]:
        """Where each request's last draft came from ("own", "group", "global"; None: it drafted nothing)."""
        codes: list[int] = self._core.last_sources([self._handle(r) for r in request_ids])
        return [DRAFT_SOURCES[code] if code >= 0 else None for code in codes]

    def last_match_lengths(self, request_ids: Sequence[Hashable]) -> list[int]:
        """The match length behind each request's last draft (0 where it drafted nothing): its evidence."""
        lengths: list[int] = self._core.last_match_lengths([self._handle(r) for r in request_ids])
        return lengths

    # -- tokens and drafts -----------------------------------------------------------
    def append(self, request_id: Hashable, tokens: Sequence[int] | npt.NDArray[Any]) -> None:
        """Index tokens the request generated (accepted drafts and the bonus token)."""
        self._core.append(self._handle(request_id), as_token_array(tokens))

    def propose(self, request_id: Hashable, k: int) -> list[int]:
        """Up to ``k`` draft tokens for the request's next positions (may be empty)."""
        result: list[int] = self._core.propose(self._handle(request_id), _check_k(k))
        return result

    def step(self, request_ids: Sequence[Hashable], new_tokens: Sequence[Sequence[int] | npt.NDArray[Any]],
             k: int) -> list[list[int]]:
        """Append each row's new tokens, then draft for every row, in one native call.

        Takes and returns plain lists (the shape vLLM's proposer interface uses); integer
        numpy arrays work as rows too.
        """
        if len(request_ids) != len(new_tokens):
            raise ValueError("request_ids and new_tokens must have the same length")
        handles = [self._handle(r) for r in request_ids]
        drafts: list[list[int]] = self._core.step_lists(handles, new_tokens, _check_k(k))
        return drafts

    def step_arrays(self, handles: npt.NDArray[np.int64], tokens: Int32Array, offsets: npt.NDArray[np.int64],
                    k: int) -> tuple[Int32Array, Int32Array]:
        """Zero-copy batch step on native handles (see `handle`): (drafts[rows, k] padded -1, lengths)."""
        k = _check_k(k)
        drafts = np.empty((len(handles), k), dtype=np.int32)
        lengths = np.empty(len(handles), dtype=np.int32)
        self._core.step(handles, tokens, offsets, k, drafts, lengths)
        return drafts, lengths

    # -- introspection ---------------------------------------------------------------
    def handle(self, request_id: Hashable) -> int:
        """The native handle of an active request (for `step_arrays`)."""
        return self._handle(request_id)

    def info(self, request_id: Hashable) -> dict[str, Any]:
        """Tokens indexed, current match length, overflow flags and group of a request."""
        info: dict[str, Any] = self._core.info(self._handle(request_id))
        return info

    @property
    def num_requests(self) -> int:
        """Active requests."""
        return int(self._core.num_requests)

    @property
    def num_groups(self) -> int:
        """Groups with at least one active member."""
        return int(self._core.num_groups)

    def memory_bytes(self) -> int:
        """Bytes held by all automata (tokens, states, transitions), the global index included."""
        return int(self._core.memory_bytes())

    @property
    def global_tokens(self) -> int:
        """Tokens of finished responses held by the global index (0 when it is off)."""
        return int(self._core.global_tokens)

    def has_group(self, group: Hashable) -> bool:
        """Whether ``group`` has a live member (its automaton exists)."""
        return group in self._groups

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._handles

    def _handle(self, request_id: Hashable) -> int:
        try:
            return self._handles[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def _new_handle(self) -> int:
        self._next_handle += 1
        return self._next_handle


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= int(k) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"k must be an integer between 1 and {MAX_DRAFT_TOKENS}, got {k!r}")
    return int(k)
