"""The SAM drafter: many concurrent requests, optional GRPO groups, one call per step.

`SamDrafter` wraps the native core (``service/csrc``).  Requests are keyed by any
hashable id (vLLM's request ids are strings); groups likewise.  The wrapper keeps
only the id-to-handle maps: every per-token loop runs in C++ with the GIL released.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Union, cast, get_args, get_origin, get_type_hints

import numpy as np
import numpy.typing as npt

from samrollout._core import MAX_DRAFT_TOKENS, core
from samrollout.tokens import Int32Array, as_token_array

Occurrence = Literal["first", "recent", "frequent"]
Source = Literal["own", "group", "both"]
Proposals = Literal["copies", "counted"]
DraftSourceName = Literal["own", "group", "global"]
DRAFT_SOURCES: tuple[DraftSourceName, ...] = get_args(DraftSourceName)
# The native core's DraftSource values by name (service/csrc/drafter.hpp); a step reports -1 for no draft.
_SOURCE_NAMES: dict[int, DraftSourceName] = {int(member.value): cast(DraftSourceName, member.name)
                                             for member in core.DraftSource}
# Every enum the policy names by value must be the native core's, member for member: a mismatch is a
# rebuilt core out of step with this module, said at import rather than as a KeyError mid-rollout.
for _native_enum, _names in ((core.DraftSource, DRAFT_SOURCES), (core.Occurrence, get_args(Occurrence)),
                             (core.Source, get_args(Source)), (core.Proposals, get_args(Proposals))):
    _native_names = sorted(member.name for member in _native_enum)
    if _native_names != sorted(_names):
        raise ImportError(f"the native core's {_native_enum.__name__} values {_native_names} are not {sorted(_names)}:"
                          " rebuild the core (make install) or update samrollout/drafter.py")
# What min_match_length="auto" becomes (see DraftPolicy): verifying drafts is compute-bound on CPUs.
CPU_MIN_MATCH_LENGTH = 2
ACCELERATOR_MIN_MATCH_LENGTH = 1


@dataclass(frozen=True)
class DraftPolicy:
    """How drafts are chosen: the native core's policy (``DraftPolicy`` in service/csrc/drafter.hpp).

    Each field is one knob of the native struct, set by name; its range is checked there
    (`validate`, ValueError naming the field) when the policy is built, so Python and the core
    never disagree.  Each field's metadata says what it does; how the defaults were measured:
    ``docs/tuning.md#draft-policy-how-the-defaults-were-chosen``.  A new knob is a field of the
    native struct with its check, one ``def_rw`` line in binding.cpp and one field here: the
    replay's flags, config files and the server's ``--draft-policy`` take it from the dataclass.
    """

    occurrence: Occurrence = field(default="recent", metadata={"description": (
        'which earlier occurrence of the matched suffix drafts: "first", "recent" (the latest: reasoning loops '
        'repeat their latest variant) or "frequent" (token by token the continuation seen most often, so one '
        'stray sibling does not lead the draft)')})
    min_probability: float = field(default=0.0, metadata={"description": (
        '"frequent" only: a draft stops where its estimated acceptance probability falls below this (0: draft '
        'up to k); cuts drafts where siblings disagree')})
    min_match_length: int | Literal["auto"] = field(default="auto", metadata={"description": (
        'shortest match that drafts, or "auto": 2 on CPU (a rejected draft costs real compute there), 1 on GPUs '
        'and NPUs and outside an engine (verifying drafts is nearly free)')})
    match_scale: float = field(default=0.0, metadata={"description": (
        "> 0: a match of L tokens drafts at most max(1, floor(scale * L)); 0 drafts the full k (the best mean "
        "accepted length)")})
    source: Source = field(default="both", metadata={"description": (
        "what a request in a group drafts from: its own automaton, its group's, or both (the longer match, see "
        "group_margin)")})
    group_margin: int = field(default=4, metadata={"description": (
        '"both": the group\'s match wins only when longer than the own by more than this (a request in a loop '
        "predicts itself better than a sibling with a slightly longer match)")})
    max_request_tokens: int = field(default=1 << 22, metadata={"description": (
        "tokens a request's own automaton may index; past them it is freed and drafts nothing (a hard memory "
        "bound, the request keeps running)")})
    max_group_tokens: int = field(default=1 << 24, metadata={"description": (
        "tokens a group's automaton may index; past them it is freed and drafts nothing")})
    max_global_tokens: int = field(default=0, metadata={"description": (
        "the global index of finished responses to every prompt, in tokens (about 150 bytes each); 0: off (it "
        "gained under 1 percent on real reasoning traces)")})
    global_margin: int = field(default=4, metadata={"description": (
        "a global draft wins when its match is longer than the own or group match by more than this (other "
        "prompts' text is weaker evidence than the request's own and its group's)")})
    proposals: Proposals = field(default="copies", metadata={"description": (
        'the adaptive policy\'s candidates: "copies" (each source\'s text after the recent occurrence of the '
        'match) or "counted" (also the continuation counted most often after the match, pruned where its '
        "probability estimate falls below min_probability, and a second path where the counts split; each "
        "token's count share and support are the acceptance model's evidence; the automata keep counts)")})

    def __post_init__(self) -> None:
        for name, hint in policy_field_types().items():
            value = getattr(self, name)
            if not _is_instance(value, hint):
                raise ValueError(f"{name} must be {_describe(hint)}, got {value!r}")
        self._native(settled=False).validate()

    def native(self, vocab_size: int) -> Any:
        """The native core's policy (``samrollout._sam_core.DraftPolicy``) for ``vocab_size`` token ids;
        "auto" must be settled first (`for_hardware`)."""
        policy = self._native(settled=True)
        policy.vocab_size = vocab_size
        policy.validate()
        return policy

    def _native(self, settled: bool) -> Any:
        """The fields set by name on the native struct (enums by their value names).  A Python-only value
        ("auto") is left at the native default unless ``settled``, where it is an error."""
        policy = core.DraftPolicy()
        for knob in fields(self):
            value = getattr(self, knob.name)
            try:
                current = getattr(policy, knob.name)
            except AttributeError:
                raise TypeError(f"DraftPolicy.{knob.name} has no native field: add it to "
                                f"service/csrc/drafter.hpp and binding.cpp") from None
            if isinstance(current, enum.Enum):
                value = type(current)[value]
            elif isinstance(value, str):
                if settled:
                    raise ValueError(f"{knob.name}={value!r} must be settled (DraftPolicy.for_hardware) first")
                continue
            elif isinstance(value, np.generic):
                value = value.item()
            try:
                setattr(policy, knob.name, value)
            except TypeError:  # past what the native field holds
                raise ValueError(f"{knob.name} is out of range, got {value!r}") from None
        return policy

    def as_dict(self) -> dict[str, Any]:
        """The policy as plain data (for JSON reports and configs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DraftPolicy:
        """A policy from plain data (`as_dict`, a config file, a flag); unknown fields raise ValueError."""
        known = [knob.name for knob in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown draft policy fields {unknown}; known: {known}")
        return cls(**values)

    def for_hardware(self, on_cpu: bool) -> DraftPolicy:
        """This policy with "auto" settled for the hardware that verifies the drafts."""
        if self.min_match_length != "auto":
            return self
        return replace(self, min_match_length=CPU_MIN_MATCH_LENGTH if on_cpu else ACCELERATOR_MIN_MATCH_LENGTH)


@functools.cache
def policy_field_types() -> dict[str, Any]:
    """DraftPolicy's fields and their annotations, resolved."""
    hints = get_type_hints(DraftPolicy)
    return {knob.name: hints[knob.name] for knob in fields(DraftPolicy)}


def _is_instance(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits a field annotation: int (not bool or float), float (any real number but
    bool), a Literal's values, or a union of those."""
    origin = get_origin(hint)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in get_args(hint))
    if origin in (Union, types.UnionType):
        return any(_is_instance(value, arm) for arm in get_args(hint))
    if isinstance(value, bool) and hint is not bool:
        return False
    if hint is int:
        return isinstance(value, int | np.integer)
    if hint is float:
        return isinstance(value, int | float | np.integer | np.floating)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A field annotation in words, for error messages."""
    origin = get_origin(hint)
    if origin is Literal:
        return f"one of {get_args(hint)}"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in get_args(hint))
    return {int: "an integer", float: "a number"}.get(hint, getattr(hint, "__name__", str(hint)))


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """Raise ValueError unless ``value`` is an integer (not a bool or float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer between {low} and {high}, got {value!r}")


@dataclass(frozen=True)
class Draft:
    """One request's draft: its tokens, the length of the match behind them (its evidence), where it came
    from, and how many of its leading tokens every earlier occurrence of the match continued with (``certain``);
    ``match_length`` 0 and ``source`` None where it drafted nothing."""

    tokens: list[int]
    match_length: int = 0
    source: DraftSourceName | None = None
    certain: int = 0


@dataclass(frozen=True)
class StepDrafts:
    """One `SamDrafter.step`'s drafts, row for row: the tokens (vLLM's proposer shape), the match
    length behind each (0: no draft), each one's source (None: no draft) and its certain prefix."""

    tokens: list[list[int]]
    match_lengths: list[int]
    sources: list[DraftSourceName | None]
    certain: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, row: int) -> Draft:
        return Draft(self.tokens[row], self.match_lengths[row], self.sources[row], self.certain[row])


@dataclass(frozen=True)
class CountedPaths:
    """A request's counted proposals (`SamDrafter.counted_paths`): the majority path, the second path (where
    the counts split), the context length behind them, and per token (its count, its context's continuations)."""

    main: list[int]
    second: list[int]
    match_length: int
    main_evidence: list[tuple[int, int]]
    second_evidence: list[tuple[int, int]]


@dataclass(frozen=True)
class DraftArrays:
    """One `SamDrafter.step_arrays`'s drafts, the arrays the core wrote into: ``drafts[rows, k]``
    (padded with -1), ``lengths``, ``match_lengths`` (0: no draft), ``sources`` (native DraftSource
    values, -1: no draft; `source` names one) and ``certain`` (each draft's certain prefix)."""

    drafts: Int32Array
    lengths: Int32Array
    match_lengths: Int32Array
    sources: Int32Array
    certain: Int32Array

    def source(self, row: int) -> DraftSourceName | None:
        """Where row ``row``'s draft came from (None: it drafted nothing)."""
        return source_name(int(self.sources[row]))


@dataclass(frozen=True)
class Candidates:
    """One `SamDrafter.step_candidates`'s drafts: every source's draft for every row, as arrays indexed
    [row, source] (source: the position of its name in `DRAFT_SOURCES`): ``drafts[rows, sources, k]`` (padded
    with -1), ``lengths`` (0: that source has nothing), ``match_lengths`` and ``certain``."""

    drafts: Int32Array
    lengths: Int32Array
    match_lengths: Int32Array
    certain: Int32Array


@dataclass(frozen=True)
class ChosenDrafts:
    """One `SamDrafter.step_goodput`'s drafts, as arrays: ``drafts[rows, k]`` (padded with -1), ``lengths``
    (0: none), and the chosen candidate's ``match_lengths``, ``sources`` (native DraftSource values, -1: none)
    and ``certain`` prefix."""

    drafts: Int32Array
    lengths: Int32Array
    match_lengths: Int32Array
    sources: Int32Array
    certain: Int32Array


def source_name(code: int) -> DraftSourceName | None:
    """The name of a native DraftSource value (None for -1: no draft)."""
    return _SOURCE_NAMES.get(code)


class SamDrafter:
    """Suffix-automaton drafts for a changing set of requests.

    Lifecycle: `add_request` (prompt, optional group) -> `append` / `step` as tokens are
    accepted -> `propose` -> `remove_request` (frees the request; the last sibling to
    leave frees its group's automaton).  Not a per-request object on purpose: one engine
    step is one `step_arrays` call for the whole batch.
    """

    def __init__(self, vocab_size: int, policy: DraftPolicy | None = None) -> None:
        self.policy = (policy or DraftPolicy()).for_hardware(on_cpu=False)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer) \
                or not 1 <= vocab_size <= np.iinfo(np.int32).max:
            raise ValueError(f"vocab_size must be a positive 32-bit integer, got {vocab_size!r}")
        self.vocab_size = int(vocab_size)
        self._core = core.Core(self.policy.native(self.vocab_size))
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

    # -- tokens and drafts -----------------------------------------------------------
    def append(self, request_id: Hashable, tokens: Sequence[int] | npt.NDArray[Any]) -> None:
        """Index tokens the request generated (accepted drafts and the bonus token)."""
        self._core.append(self._handle(request_id), as_token_array(tokens))

    def propose(self, request_id: Hashable, k: int) -> Draft:
        """Up to ``k`` draft tokens for the request's next positions (may be none), their match and source."""
        draft = self._core.propose(self._handle(request_id), _check_k(k))
        return Draft(draft.tokens, draft.match_length, None if draft.source is None else draft.source.name,
                     draft.certain)

    def counted_paths(self, request_id: Hashable, k: int) -> CountedPaths:
        """The request's counted proposals of up to ``k`` tokens as the adaptive policy makes them (empty unless
        the policy's ``proposals`` is "counted"): the majority path and the second path, with each token's count
        and its context's continuations."""
        paths = self._core.counted(self._handle(request_id), _check_k(k))
        return CountedPaths(list(paths.main), list(paths.second), paths.match_length,
                            list(zip(paths.main_counts, paths.main_totals, strict=True)),
                            list(zip(paths.second_counts, paths.second_totals, strict=True)))

    def step(self, request_ids: Sequence[Hashable], new_tokens: Sequence[Sequence[int] | npt.NDArray[Any]],
             k: int) -> StepDrafts:
        """Append each row's new tokens, then draft for every row, in one native call.

        Takes plain lists and returns them (``tokens``: the shape vLLM's proposer interface uses);
        integer numpy arrays work as rows too.
        """
        if len(request_ids) != len(new_tokens):
            raise ValueError("request_ids and new_tokens must have the same length")
        handles = [self._handle(r) for r in request_ids]
        drafts, match_lengths, sources, certain = self._core.step_lists(handles, new_tokens, _check_k(k))
        return StepDrafts(drafts, match_lengths, [_SOURCE_NAMES.get(code) for code in sources], certain)

    def step_candidates(self, request_ids: Sequence[Hashable],
                        new_tokens: Sequence[Sequence[int] | npt.NDArray[Any]], k: int) -> Candidates:
        """Append each row's new tokens, then draft for every row from each source alone (own automaton,
        group, global index), in one native call: the drafting policy chooses among them (`Candidates`)."""
        if len(request_ids) != len(new_tokens):
            raise ValueError("request_ids and new_tokens must have the same length")
        k = _check_k(k)
        rows, sources = len(request_ids), len(DRAFT_SOURCES)
        out = Candidates(np.empty((rows, sources, k), dtype=np.int32),
                         *(np.empty((rows, sources), dtype=np.int32) for _ in range(3)))
        self._core.step_candidates([self._handle(r) for r in request_ids], new_tokens, k, out.drafts, out.lengths,
                                   out.match_lengths, out.certain)
        return out

    def step_goodput(self, request_ids: Sequence[Hashable], new_tokens: Sequence[Sequence[int] | npt.NDArray[Any]],
                     k: int, greedy: npt.NDArray[np.uint8], limits: Int32Array, weights: npt.NDArray[np.float64],
                     seconds: npt.NDArray[np.float64]) -> ChosenDrafts:
        """One step of the adaptive policy, in one native call (``service/csrc/goodput.hpp``): append each row's
        new tokens, score every source's last candidate against them, then give each row the source expected to
        be accepted longest, cut to the length that maximises the batch's weighted expected tokens per second.

        Per row: ``greedy`` (1: greedy; its acceptance is counted apart), ``limits`` (most draft tokens; 0: none,
        and not scored next step), ``weights``; ``seconds[n]``: the step's seconds with n draft tokens in all."""
        if len(request_ids) != len(new_tokens):
            raise ValueError("request_ids and new_tokens must have the same length")
        k = _check_k(k)
        rows = len(request_ids)
        out = ChosenDrafts(np.empty((rows, k), dtype=np.int32), *(np.empty(rows, dtype=np.int32) for _ in range(4)))
        self._core.step_goodput([self._handle(r) for r in request_ids], new_tokens, k, greedy, limits, weights,
                                seconds, out.drafts, out.lengths, out.match_lengths, out.sources, out.certain)
        return out

    def acceptance_table(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """The adaptive policy's first-token (observations, acceptances) per [source, match bucket] (zeros before
        its first step); `DRAFT_SOURCES` orders the sources, `match_bucket` names the buckets."""
        seen = np.zeros((len(DRAFT_SOURCES), int(core.MATCH_BUCKETS)))
        accepted = np.zeros_like(seen)
        self._core.acceptance_table(seen, accepted)
        return seen, accepted

    def step_arrays(self, handles: npt.NDArray[np.int64], tokens: Int32Array, offsets: npt.NDArray[np.int64],
                    k: int) -> DraftArrays:
        """Zero-copy batch step on native handles (see `handle`): the core writes every row's draft, its
        length, match, source and certain prefix into fresh arrays (`DraftArrays`)."""
        k = _check_k(k)
        rows = len(handles)
        out = DraftArrays(*(np.empty(shape, dtype=np.int32) for shape in ((rows, k), rows, rows, rows, rows)))
        self._core.step(handles, tokens, offsets, k, out.drafts, out.lengths, out.match_lengths, out.sources,
                        out.certain)
        return out

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


def match_bucket(match_length: int) -> int:
    """The adaptive policy's half-octave bucket of a match length (0: none; 1, 2, 3, 4-5, 6-7, 8-11, ...)."""
    return int(core.match_bucket(int(match_length)))
