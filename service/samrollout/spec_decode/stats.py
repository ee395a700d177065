"""The proposer's statistics as one typed record, from the engine's worker to the server, metrics, benches and tests.

`DraftSession.stats` makes a `ProposerStats` (counters since start and the settings in force) and
`SamProposer.stats` returns it.  The proposer runs in vLLM's worker process: the worker extension
(``samrollout_drafter_stats``) adds whether vLLM's rejection sampler is patched and sends the
record over ``collective_rpc`` as plain JSON (`ProposerStats.to_json`); the server rebuilds it
(`ProposerStats.from_json`) for ``/admin/status`` and ``/metrics``.  Readers use attributes: a
renamed field is a type error, and `from_json` rejects unknown and missing keys (`ValueError`)
instead of reading them as zero.

The JSON is what ``/admin/status`` reports under ``"drafter"``: the fields by name, with
``steps_by_batch_size`` / ``drafting_steps_by_batch_size`` keyed by the batch size as a string
(JSON keys), ``draft_range`` as ``[[running, k], ...]``, ``policy`` as `DraftPolicy.as_dict`,
``history`` null with the history off, ``no_draft_sampling_patched`` null where nobody asked
vLLM (outside a worker), and ``step_cost`` as ``{"<2": [u, w, v, observations], ...}``: what the adaptive
policy's step-cost fit measured per batch-size octave (`samrollout.spec_decode.step_cost`; empty in the
static mode).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, cast, get_args

from samrollout.config import ThresholdMode
from samrollout.drafter import DRAFT_SOURCES, DraftPolicy, DraftSourceName

# Upper bounds (seconds) of the proposer's step-time histogram, exported as samrollout_drafter_step_seconds;
# `ProposerStats.step_seconds_counts` has one count per bound, then the count past the last.
STEP_SECONDS_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2)


@dataclass(frozen=True)
class SourceCounts:
    """Draft tokens one source (own, group, global) proposed, and how many of them the engine accepted."""

    draft_tokens: int
    accepted_tokens: int


@dataclass(frozen=True)
class HistoryStats:
    """The cross-epoch history (`samrollout.history.ResponseHistory`): what it holds, its bounds, how many
    earlier responses joined a group's automaton, and how many groups arrived (``groups``), of which how many
    found earlier responses to their prompt in it (``hit_groups``)."""

    tokens: int
    prompts: int
    max_tokens: int
    responses_per_prompt: int
    joined_responses: int
    groups: int
    hit_groups: int


@dataclass(frozen=True)
class ProposerStats:
    """The proposer's counters since start and the settings in force (see the module docstring).

    Counters: ``steps``, ``draft_tokens`` proposed and ``accepted_tokens``, sampled / seeded rows
    whose drafts were dropped (``sampled_rows_skipped``, ``seeded_rows_skipped``), confident and
    critical-path drafts, ``propose_seconds`` and the step-time histogram (``step_seconds_counts``,
    per `STEP_SECONDS_BUCKETS`), steps by batch size, per-source tokens (``sources``) and the adaptive
    policy's step-cost fit (``step_cost``, by batch-size octave such as "<8"; empty in the static mode).
    State: ``active_requests``, ``last_step_drafted``, ``global_tokens`` (the global index),
    ``history``.  Settings: ``k`` (vLLM's num_speculative_tokens), the threshold, its mode and the
    draft range, the confident and critical-path settings, the policy with "auto" settled, and
    whether the threshold is vLLM's batch-size schedule.
    """

    steps: int
    draft_tokens: int
    accepted_tokens: int
    sampled_rows_skipped: int
    seeded_rows_skipped: int
    active_requests: int
    confident_match: int
    confident_drafts: int
    confident_k: int
    longest_confident_draft: int
    critical_rows: int
    critical_k: int
    critical_drafts: int
    propose_seconds: float
    step_seconds_counts: tuple[int, ...]
    last_step_drafted: bool
    k: int
    threshold: int
    draft_range: tuple[tuple[int, int], ...]
    threshold_mode: ThresholdMode
    policy: DraftPolicy
    threshold_from_vllm_schedule: bool
    steps_by_batch_size: Mapping[int, int]
    drafting_steps_by_batch_size: Mapping[int, int]
    step_cost: Mapping[str, tuple[float, float, float, float]]
    sources: Mapping[DraftSourceName, SourceCounts]
    global_tokens: int
    history: HistoryStats | None
    # Whether vLLM's rejection sampler skips steps without drafts (`samrollout.spec_decode.no_draft_sampling`):
    # set by the worker extension; None from a session outside a vLLM worker.
    no_draft_sampling_patched: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (the layout in the module docstring); `from_json` reads it back."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["step_seconds_counts"] = list(self.step_seconds_counts)
        data["draft_range"] = [list(pair) for pair in self.draft_range]
        data["policy"] = self.policy.as_dict()
        data["steps_by_batch_size"] = _by_size_json(self.steps_by_batch_size)
        data["drafting_steps_by_batch_size"] = _by_size_json(self.drafting_steps_by_batch_size)
        data["step_cost"] = {octave: list(fit) for octave, fit in self.step_cost.items()}
        data["sources"] = {source: asdict(counts) for source, counts in self.sources.items()}
        data["history"] = None if self.history is None else asdict(self.history)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProposerStats:
        """Rebuild from `to_json` output; a missing or unknown key, or a value of the wrong type, is a ValueError."""
        _exact_keys(data, [f.name for f in fields(cls)], "proposer stats")
        mode = data["threshold_mode"]
        if mode not in get_args(ThresholdMode):
            raise ValueError(f"proposer stats: threshold_mode must be one of {get_args(ThresholdMode)}, got {mode!r}")
        policy = data["policy"]
        _exact_keys(policy, [f.name for f in fields(DraftPolicy)], "proposer stats: policy")
        sources = data["sources"]
        _exact_keys(sources, DRAFT_SOURCES, "proposer stats: sources")
        step_cost = data["step_cost"]
        if not isinstance(step_cost, Mapping):
            raise ValueError(f"proposer stats: step_cost must be an object, got {step_cost!r}")
        patched = data["no_draft_sampling_patched"]
        return cls(
            steps=_int(data, "steps"), draft_tokens=_int(data, "draft_tokens"),
            accepted_tokens=_int(data, "accepted_tokens"), sampled_rows_skipped=_int(data, "sampled_rows_skipped"),
            seeded_rows_skipped=_int(data, "seeded_rows_skipped"), active_requests=_int(data, "active_requests"),
            confident_match=_int(data, "confident_match"), confident_drafts=_int(data, "confident_drafts"),
            confident_k=_int(data, "confident_k"), longest_confident_draft=_int(data, "longest_confident_draft"),
            critical_rows=_int(data, "critical_rows"), critical_k=_int(data, "critical_k"),
            critical_drafts=_int(data, "critical_drafts"), propose_seconds=_float(data, "propose_seconds"),
            step_seconds_counts=_step_counts(data["step_seconds_counts"]),
            last_step_drafted=_bool(data, "last_step_drafted"), k=_int(data, "k"), threshold=_int(data, "threshold"),
            draft_range=_draft_range(data["draft_range"]), threshold_mode=cast(ThresholdMode, mode),
            policy=DraftPolicy.from_dict(dict(policy)),
            threshold_from_vllm_schedule=_bool(data, "threshold_from_vllm_schedule"),
            steps_by_batch_size=_by_size(data["steps_by_batch_size"], "steps_by_batch_size"),
            drafting_steps_by_batch_size=_by_size(data["drafting_steps_by_batch_size"],
                                                  "drafting_steps_by_batch_size"),
            step_cost={str(octave): _step_cost_fit(fit, f"step_cost[{octave!r}]") for octave, fit in step_cost.items()},
            sources={source: _source_counts(sources[source], f"sources[{source!r}]") for source in DRAFT_SOURCES},
            global_tokens=_int(data, "global_tokens"),
            history=None if data["history"] is None else _history(data["history"]),
            no_draft_sampling_patched=None if patched is None else _bool(data, "no_draft_sampling_patched"))


# -- JSON helpers -----------------------------------------------------------------------------
def _exact_keys(data: object, expected: Collection[str], where: str) -> None:
    """ValueError unless ``data`` is an object with exactly the ``expected`` keys."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    missing, unknown = sorted(set(expected) - set(data)), sorted(set(data) - set(expected))
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}")


def _int(data: Mapping[str, Any], key: str, where: str = "proposer stats") -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _float(data: Mapping[str, Any], key: str, where: str = "proposer stats", nan_if_null: bool = False) -> float:
    value = data[key]
    if value is None and nan_if_null:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _bool(data: Mapping[str, Any], key: str) -> bool:
    value = data[key]
    if not isinstance(value, bool):
        raise ValueError(f"proposer stats: {key} must be true or false, got {value!r}")
    return value


def _int_list(values: object, where: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"proposer stats: {where} must be a list of integers, got {values!r}")
    return list(values)


def _step_counts(values: object) -> tuple[int, ...]:
    counts = _int_list(values, "step_seconds_counts")
    if len(counts) != len(STEP_SECONDS_BUCKETS) + 1:
        raise ValueError(f"proposer stats: step_seconds_counts needs {len(STEP_SECONDS_BUCKETS) + 1} counts "
                         f"(one per STEP_SECONDS_BUCKETS bound, then +Inf), got {len(counts)}")
    return tuple(counts)


def _draft_range(values: object) -> tuple[tuple[int, int], ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"proposer stats: draft_range must be a list of [running, k] pairs, got {values!r}")
    pairs = [_int_list(pair, "draft_range's pairs") for pair in values]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"proposer stats: draft_range must be a list of [running, k] pairs, got {values!r}")
    return tuple((running, k) for running, k in pairs)


def _by_size_json(counts: Mapping[int, int]) -> dict[str, int]:
    """Counts keyed by batch size as JSON keys, smallest first."""
    return {str(size): count for size, count in sorted(counts.items())}


def _by_size(data: object, where: str) -> dict[int, int]:
    if not isinstance(data, Mapping):
        raise ValueError(f"proposer stats: {where} must be an object, got {data!r}")
    try:
        sizes = {int(size): size for size in data}
    except ValueError:
        raise ValueError(f"proposer stats: {where} must be keyed by batch size, got {sorted(data)}") from None
    return {size: _int(data, key, f"proposer stats: {where}") for size, key in sorted(sizes.items())}


def _step_cost_fit(data: object, where: str) -> tuple[float, float, float, float]:
    if not isinstance(data, list | tuple) or len(data) != 4 or \
            any(isinstance(x, bool) or not isinstance(x, int | float) for x in data):
        raise ValueError(f"proposer stats: {where} must be [level, switch, draft weight, observations], got {data!r}")
    return float(data[0]), float(data[1]), float(data[2]), float(data[3])


def _source_counts(data: object, where: str) -> SourceCounts:
    _exact_keys(data, [f.name for f in fields(SourceCounts)], f"proposer stats: {where}")
    row = cast(Mapping[str, Any], data)
    here = f"proposer stats: {where}"
    return SourceCounts(_int(row, "draft_tokens", here), _int(row, "accepted_tokens", here))


def _history(data: object) -> HistoryStats:
    names = [f.name for f in fields(HistoryStats)]
    _exact_keys(data, names, "proposer stats: history")
    row = cast(Mapping[str, Any], data)
    return HistoryStats(**{name: _int(row, name, "proposer stats: history") for name in names})
