"""One typed configuration for speculation, shared by the server and the Python API.

`SpeculationConfig` travels to vLLM's worker processes inside
``VllmConfig.additional_config["samrollout"]`` (plain JSON), where the proposer
rebuilds it; invalid values raise `ValueError` when the object is made, i.e. at
start-up, never mid-rollout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from importlib.resources import files
from typing import Any, Literal, get_args

from samrollout._core import MAX_DRAFT_TOKENS
from samrollout.drafter import DraftPolicy, check_int

ThresholdMode = Literal["off", "static", "adaptive"]
SampledMode = Literal["auto", "draft", "skip"]
_SAMPLED: tuple[SampledMode, ...] = ("auto", "draft", "skip")
_MODES: tuple[ThresholdMode, ...] = ("off", "static", "adaptive")
ADDITIONAL_CONFIG_KEY = "samrollout"
# Requests that share this value in SamplingParams.extra_args draft from one group automaton.
GROUP_FIELD = "samrollout_group"
# The request's rollout id in SamplingParams.extra_args (the drafter counts a group's arrival once per rollout).
ROLLOUT_FIELD = "samrollout_rollout"
# The most drafts per step a request's k (and a draft range's k) may ask for; critical-path drafts may go to
# the core's MAX_DRAFT_TOKENS.
MAX_K = 16
MAX_CRITICAL_WEIGHT = 1024.0  # the largest critical_weight (a row weighs at most this many rows' tokens)
# The range (low, high; None: unbounded) of each integer speculation setting: one range for SpeculationConfig,
# the server's flags and variables, and the Helm chart's schema (tests/test_helm_chart.py compares them).
SPECULATION_LIMITS: dict[str, tuple[int, int | None]] = {
    "k": (1, MAX_K),
    "threshold": (1, None),
    "history_tokens": (0, 1 << 30),
    "history_responses": (1, 1024),
    "confident_match": (0, 1 << 30),
    "critical_rows": (0, 1 << 30),
    "critical_k": (1, MAX_DRAFT_TOKENS),
    "max_draft": (1, MAX_DRAFT_TOKENS),
}


@dataclass(frozen=True)
class SpeculationConfig:
    """SAM speculation settings: one object for the server, the Python API, the replay and the simulator.

    How each default was chosen, with its measurements: docs/tuning.md, "Speculation settings: how the
    defaults were chosen".  Integer ranges are `SPECULATION_LIMITS`.

    - ``threshold_mode``: how much each row drafts.  "adaptive" (the default): every step, each row's source
      and draft length (0 to ``max_draft``) maximise the batch's expected accepted tokens per second of step
      time, from acceptance by kind of match and a step-cost curve both learned online
      (`samrollout.spec_decode.goodput`); the published threshold is where it drafts nothing for anyone.
      "static": the published rule, ``k`` drafts while at most ``threshold`` requests run (and the static
      knobs below); "off": ``k`` drafts at every batch size.
    - ``max_draft``: adaptive: the longest draft a row may get (vLLM's ``num_speculative_tokens``); a looping
      response accepts long drafts at any batch size.
    - ``cost_prior``: adaptive: the step-cost curve before the engine's own step times correct it: "linear" (a
      compute-bound step) or the path of a measured cost table (``bench/verify_cost.py``); the server's "auto"
      picks the device's table where the package ships one.
    - ``critical_rows`` / ``critical_weight``: adaptive: the ``critical_rows`` running requests with the
      longest outputs so far (and longer than every other's) weigh ``critical_weight`` in the goodput (a
      synchronous step ends with its longest response); 0 rows or weight 1: off.
    - ``group_drafting``: siblings (the n children of a request, or requests with the same
      ``extra_args["samrollout_group"]``) draft from a shared group automaton.
    - ``sampled_requests``: whether requests with temperature > 0 get drafts: "draft" always, "skip" never,
      "auto" wherever vLLM verifies them exactly (vLLM's CPU backend with our
      `samrollout.spec_decode.cpu_sampled_verification` patch included), except sampled requests with their
      own ``seed``: with drafts, what a seed gives would depend on what else the server ran.
    - ``policy``: the drafter's `DraftPolicy`.
    - ``history_tokens`` / ``history_responses``: cross-epoch history (`samrollout.history`): responses of
      earlier rollouts to the same prompt join the group automaton of a later rollout's responses to it, at most
      ``history_responses`` (the newest) per prompt and ``history_tokens`` tokens in all (LRU; 0: off).  Kept
      across weight updates: they are only drafts.  With it on, requests without a group id are grouped by
      prompt.

    The static mode's knobs (explicit overrides of the adaptive policy, kept for comparisons and for engines
    whose cost the policy cannot learn):

    - ``k``: draft tokens per step below the threshold (and the length of confident drafts past it).
    - ``threshold``: the static threshold (running requests).
    - ``draft_range``: the draft length by batch size (Seer's adaptive draft range), ``((up_to_running, k),
      ...)`` with ascending counts: k drafts while at most that many requests run, none above the last.  None:
      ``k`` up to ``threshold``.
    - ``confident_match``: rows whose draft comes from a match of at least this many tokens draft at every
      batch size, at most ``k`` tokens (0: off).
    - ``critical_rows`` / ``critical_k``: at every batch size the ``critical_rows`` running requests with the
      longest outputs so far (and longer than every other's) draft up to ``critical_k`` tokens (0 rows: off).

    With confident or critical-path drafts on, vLLM gets no batch-size schedule: the proposer applies the range
    itself (`drafts_past_the_range`).
    """

    k: int = 3
    threshold_mode: ThresholdMode = "adaptive"
    threshold: int = 8
    group_drafting: bool = True
    sampled_requests: SampledMode = "auto"
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    draft_range: tuple[tuple[int, int], ...] | None = None
    history_tokens: int = 1 << 22
    history_responses: int = 4
    confident_match: int = 8
    critical_rows: int = 0
    critical_k: int = 16
    max_draft: int = 32
    cost_prior: str = "linear"
    critical_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in SPECULATION_LIMITS:
            check_limit(name, getattr(self, name))
        if self.threshold_mode not in _MODES:
            raise ValueError(f"threshold_mode must be one of {_MODES}, got {self.threshold_mode!r}")
        if self.sampled_requests not in _SAMPLED:
            raise ValueError(f"sampled_requests must be one of {_SAMPLED}, got {self.sampled_requests!r}")
        if not isinstance(self.group_drafting, bool):
            raise ValueError(f"group_drafting must be true or false, got {self.group_drafting!r}")
        if self.draft_range is not None:
            object.__setattr__(self, "draft_range", checked_draft_range(self.draft_range))
        weight = self.critical_weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 1.0 <= weight <= MAX_CRITICAL_WEIGHT:
            raise ValueError(f"critical_weight must be a number between 1 and {MAX_CRITICAL_WEIGHT}, got {weight!r}")
        if not isinstance(self.cost_prior, str) or not self.cost_prior:
            raise ValueError(f"cost_prior must be 'linear' or the path of a cost table, got {self.cost_prior!r}")

    def effective_range(self) -> tuple[tuple[int, int], ...]:
        """The draft length by batch size in force: ``draft_range``, or k up to the threshold."""
        return self.draft_range if self.draft_range is not None else ((self.threshold, self.k),)

    def largest_draft(self) -> int:
        """vLLM's ``num_speculative_tokens``: the most drafts any step asks for."""
        if self.threshold_mode == "adaptive":
            return self.max_draft
        base = self.k if self.draft_range is None or self.threshold_mode != "static" else \
            max(k for _, k in self.draft_range)
        return max(base, self.critical_k) if self.critical_rows else base

    def drafts_past_the_range(self) -> bool:
        """Whether some rows draft beyond the draft range (confident or critical-path drafts; every adaptive
        draft): then the proposer applies the range itself, not vLLM's batch-size schedule."""
        return self.threshold_mode == "adaptive" or bool(self.confident_match or self.critical_rows)

    def to_json(self) -> dict[str, Any]:
        """Plain data (for vLLM's additional_config and reports)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpeculationConfig:
        """Rebuild from `to_json` output; unknown keys are an error, not silently dropped."""
        data = dict(data)
        policy = DraftPolicy.from_dict(data.pop("policy", {}))
        unknown = set(data) - {item.name for item in fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculation settings: {sorted(unknown)}")
        if data.get("draft_range") is not None:
            data["draft_range"] = tuple(tuple(pair) for pair in data["draft_range"])
        return cls(policy=policy, **data)


def check_limit(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an integer in the range `SPECULATION_LIMITS` gives ``name``."""
    low, high = SPECULATION_LIMITS[name]
    if high is not None:
        check_int(name, value, low, high)
    elif isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")


def checked_draft_range(pairs: Any) -> tuple[tuple[int, int], ...]:
    """``((up_to_running, k), ...)`` validated: ascending counts >= 1, k from 0 to `MAX_K`, at least one pair."""
    try:
        result = tuple((int(running), int(k)) for running, k in pairs)
    except (TypeError, ValueError):
        raise ValueError(f"draft_range must be (running requests, k) pairs, got {pairs!r}") from None
    if not result:
        raise ValueError("draft_range needs at least one (running requests, k) pair")
    previous = 0
    for running, k in result:
        if running <= previous:
            raise ValueError(f"draft_range's running-request counts must ascend from 1, got {[r for r, _ in result]}")
        if not 0 <= k <= MAX_K:
            raise ValueError(f"draft_range's k must be between 0 and {MAX_K}, got {k} (at {running} running)")
        previous = running
    if max(k for _, k in result) == 0:
        raise ValueError("draft_range drafts nothing at any batch size: turn speculation off instead")
    return result


def parse_draft_range(text: str) -> tuple[tuple[int, int], ...]:
    """``"2:16,8:8"`` -> ((2, 16), (8, 8)): k drafts while at most that many requests run."""
    pairs = []
    for part in text.split(","):
        running, sep, k = part.strip().partition(":")
        if not sep or not running.strip().isdigit() or not k.strip().isdigit():
            raise ValueError(f"draft range {text!r}: write running:k pairs, e.g. 2:16,8:8")
        pairs.append((int(running), int(k)))
    return checked_draft_range(pairs)


DeviceKind = Literal["cuda", "npu", "cpu"]  # what the engine runs on: each kind has its own projected defaults
DEVICE_KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)

LONG_TAIL_DRAFTS = 8  # drafts per step while at most CUDA_LONG_DRAFT_RUNNING requests run, on CUDA GPUs
CUDA_LONG_DRAFT_RUNNING = 32  # CUDA: LONG_TAIL_DRAFTS drafts up to this many running requests
CUDA_DRAFT_RUNNING = 256  # CUDA: k drafts up to this many running requests; none above


CUDA_CRITICAL_PATH = (8, 8)  # CUDA: the 8 longest-running requests draft up to 8 tokens at every batch size
# How the settings, the Helm values and the docs write the CUDA defaults (K: --k); tests/test_default_copies.py
# fails where a copy says otherwise.
CUDA_DRAFT_RANGE_TEXT = f"{CUDA_LONG_DRAFT_RUNNING}:{LONG_TAIL_DRAFTS},{CUDA_DRAFT_RUNNING}:K"
CUDA_CRITICAL_PATH_TEXT = f"{CUDA_CRITICAL_PATH[0]}:{CUDA_CRITICAL_PATH[1]}"


def default_critical_path(setting: str, device: DeviceKind) -> tuple[int, int]:
    """(rows, k) of critical-path drafting a server setting means: "auto", "none" (0 rows) or "ROWS:K".

    auto: on CUDA GPUs ``(8, 8)``, chosen by the rollout simulator on an H100's cost table (docs/simulator.md:
    it cut the projected Sky-T1 rollout by 4.2% and left the R1-distill one within 1%); elsewhere off (on the
    CPU's table 8-token drafts for those rows cost more than they saved; Ascend NPUs have no table yet).
    """
    if setting == "none":
        return 0, SpeculationConfig.critical_k
    if setting == "auto":
        return CUDA_CRITICAL_PATH if device == "cuda" else (0, SpeculationConfig.critical_k)
    rows, sep, k = setting.strip().partition(":")
    if not sep or not rows.strip().isdigit() or not k.strip().isdigit():
        raise ValueError(f"critical path {setting!r}: write ROWS:K (e.g. 8:8), auto or none")
    if not 1 <= int(k) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"critical path {setting!r}: K must be between 1 and {MAX_DRAFT_TOKENS}")
    return int(rows), int(k)


def default_draft_range(setting: str, k: int, threshold: int,
                        device: DeviceKind) -> tuple[tuple[int, int], ...] | None:
    """The draft range a server setting means: "auto" (the device kind's projected default), "none", or pairs.

    auto: on CUDA GPUs ``((32, max(k, 8)), (256, k))``: long drafts while at most 32 requests run
    and k up to 256, chosen by the rollout simulator on an H100's cost table (docs/simulator.md:
    a verification step stays near one plain step up to batch 32 there, so drafting pays far past
    the published threshold of 8); elsewhere None: k up to the threshold (on CPUs what pays depends on
    the CPU: drafting up to 32 running led on one with native bfloat16 and trailed no drafting on one
    without, docs/tuning.md; Ascend NPUs keep the published k = 3 at 8 until a table is measured on one).
    """
    if setting == "none":
        return None
    if setting == "auto":
        if device == "cuda":
            return ((CUDA_LONG_DRAFT_RUNNING, max(k, LONG_TAIL_DRAFTS)), (CUDA_DRAFT_RUNNING, k))
        return None
    return parse_draft_range(setting)


# The step-cost table the package ships per device kind, the adaptive policy's prior there ("auto"): an H100's
# (bench/results/verify-cost-h100-k24.json, a Qwen3-8B-shaped model).  Elsewhere the linear prior.
SHIPPED_COST_TABLES: dict[DeviceKind, str] = {"cuda": "h100-qwen3-8b.json"}


def resolve_cost_prior(setting: str, device: DeviceKind) -> str:
    """The cost prior a setting means: "auto" is the table shipped for ``device`` (`SHIPPED_COST_TABLES`) or
    "linear"; "linear" and paths as they are."""
    if setting != "auto":
        return setting
    shipped = SHIPPED_COST_TABLES.get(device)
    if shipped is None:
        return "linear"
    return str(files("samrollout").joinpath("cost_tables", shipped))
