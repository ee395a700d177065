"""Typed inputs and results of the client (pydantic models, so they validate and serialise)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Prompt = str | list[int]


class Sampling(BaseModel):
    """Sampling settings sent with every request (OpenAI completion fields plus vLLM's ``top_k``)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, description="sample i of a group uses seed + i (reproducible rollouts: "
                             "seeded requests do not draft under the server's default, so they gain no speculation)")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="top logprobs per generated token")
    extra: dict[str, Any] = Field(default_factory=dict, description="other fields passed to the server as they are")


class SpecStats(BaseModel):
    """Speculation for one sample, as the server's engine verified it (None fields: not measured)."""

    mean_acceptance_length: float | None = None
    draft_acceptance_rate: float | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class SamplePiece(BaseModel):
    """The part of a moved sample generated on one endpoint (divided rollout), in order."""

    endpoint: str
    tokens: int = Field(description="how many of the sample's token ids this piece generated")
    weight_version: str | None = Field(default=None, description="the weights that generated them")


class Sample(BaseModel):
    """One generated response."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    weight_version: str | None = None
    speculation: SpecStats | None = None
    endpoint: str = Field(description="the server that produced it (a moved sample: its last piece)")
    attempts: int = Field(default=1, description="1 unless it was retried")
    moves: int = Field(default=0, description="times it was continued on another endpoint from its generated "
                                              "tokens (divided rollout: for load, or after a failure)")
    pieces: list[SamplePiece] = Field(default_factory=list, description="where each part of a moved sample was "
                                      "generated, and under which weights (empty unless moves > 0)")


class GroupResult(BaseModel):
    """The n samples of one prompt (a GRPO group), in sample order."""

    index: int
    prompt: Prompt
    group_id: str
    samples: list[Sample]


class SampleFailure(BaseModel):
    """A sample that could not be generated, and why."""

    group: int
    sample: int
    error: str


class RolloutReport(BaseModel):
    """A rollout's cost, combined over every endpoint's summary (`GET /v1/rollouts/{id}`)."""

    rollout_id: str
    endpoints: int
    sequences: int
    output_tokens: int
    makespan_s: float
    tail_s: float
    tail_share: float
    longest_tokens: int
    median_tokens: float
    mean_acceptance_length: float | None
    draft_tokens_accepted: int
    finish_reasons: dict[str, int]

    def __str__(self) -> str:
        mal = f"{self.mean_acceptance_length:.2f}" if self.mean_acceptance_length else "n/a"
        return (f"rollout {self.rollout_id}: {self.sequences} samples, {self.output_tokens} tokens in "
                f"{self.makespan_s:.1f} s ({self.output_tokens / max(self.makespan_s, 1e-9):.0f} tok/s); "
                f"tail {self.tail_s:.1f} s ({100 * self.tail_share:.0f}% of it); longest {self.longest_tokens} "
                f"vs median {self.median_tokens:.0f} tokens; acceptance length {mal}; "
                f"finish {self.finish_reasons} over {self.endpoints} endpoint(s)")


class WeightPush(BaseModel):
    """What `push_weights` did: the version every endpoint now serves, what was sent, and how long it took."""

    version: str
    endpoints: int
    files: list[str] = Field(description="the files each endpoint received, in order")
    bytes: int = Field(description="bytes of those files (one endpoint's share)")
    bytes_sent: int = Field(description="bytes sent to all endpoints together")
    upload_s: float = Field(description="opening the uploads and sending every file")
    load_s: float = Field(description="the commits (checks and load on the servers) until every endpoint serves it")
    seconds: float = Field(description="the whole push")

    @property
    def mb_per_s(self) -> float:
        """Upload rate over all endpoints together, in MB/s (10^6 bytes)."""
        return self.bytes_sent / 1e6 / max(self.upload_s, 1e-9)
