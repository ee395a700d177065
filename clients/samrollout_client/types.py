"""Typed inputs and results of the client (pydantic models, so they validate and serialise)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Prompt = str | list[int]


def is_prompt(value: object) -> bool:
    """Whether ``value`` is a prompt the server takes: a string, or a non-empty list of token ids."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value)
                                      and all(isinstance(t, int) for t in value))


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


class WeightVersionSpan(BaseModel):
    """Tokens ``start`` to ``end`` (exclusive) of a sample's ``token_ids`` were sampled by weight ``version``."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    version: str | None = None

    @property
    def tokens(self) -> int:
        """How many tokens the span covers."""
        return self.end - self.start


class SamplePiece(BaseModel):
    """The part of a moved sample generated on one endpoint (divided rollout), in order."""

    endpoint: str
    tokens: int = Field(description="how many of the sample's token ids this piece generated")
    weight_version: str | None = Field(default=None, description="the weights that generated its first token")
    weight_version_spans: list[WeightVersionSpan] = Field(
        default_factory=list, description="which of its tokens each version sampled (indexes into the piece's "
        "own tokens)")


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
    weight_version_spans: list[WeightVersionSpan] = Field(
        default_factory=list, description="which of its tokens each weight version sampled, in token order "
        "(indexes into token_ids, end exclusive, covering every token; more than one span only when a weight "
        "update with in_flight='continue' ran while it generated)")

    @property
    def versions(self) -> list[str]:
        """The weight versions that sampled its tokens, each once, oldest first (token order); [] for no tokens."""
        seen: list[str] = []
        for span in self.weight_version_spans:
            if span.version is not None and span.version not in seen:
                seen.append(span.version)
        return seen

    def token_versions(self) -> list[str | None]:
        """The version that sampled each token, one per token id (None where the server named none)."""
        versions: list[str | None] = [None] * len(self.token_ids)
        for span in self.weight_version_spans:
            versions[span.start:span.end] = [span.version] * (min(span.end, len(versions)) - span.start)
        return versions

    def staleness(self, history: Sequence[str]) -> int:
        """How many versions its oldest token lags behind the newest of ``history`` (0: all sampled by the newest).

        ``history``: weight versions in the order they were served, the newest last (the rollout's
        `PartialRollout.versions`, or the trainer's own list).  A sample whose tokens span k
        versions has staleness at least k - 1.  A version missing from ``history`` is a ValueError;
        a sample without tokens has staleness 0.
        """
        lags = self._lags(history)
        return max(lags.values(), default=0)

    def token_lags(self, history: Sequence[str]) -> list[int]:
        """For each token, how many versions the weights that sampled it lag behind the newest of ``history``.

        0 for tokens of the newest version: what an off-policy correction (decoupled PPO,
        truncated importance sampling) weighs or masks per token.  Versions as in `staleness`.
        """
        lags = self._lags(history)
        return [lags[v] if v is not None else 0 for v in self.token_versions()]

    def _lags(self, history: Sequence[str]) -> dict[str, int]:
        position = {version: index for index, version in enumerate(history)}
        missing = [v for v in self.versions if v not in position]
        if missing:
            raise ValueError(f"weight version(s) {missing} are not in the history {list(history)}")
        return {v: len(history) - 1 - position[v] for v in self.versions}


class GroupResult(BaseModel):
    """The n samples of one prompt (a GRPO group), in sample order."""

    index: int
    prompt: Prompt
    group_id: str
    samples: list[Sample]

    def staleness(self, history: Sequence[str]) -> int:
        """The largest `Sample.staleness` of its samples (0 for no samples)."""
        return max((s.staleness(history) for s in self.samples), default=0)

    @property
    def versions(self) -> list[str]:
        """The weight versions that sampled any of its samples' tokens, each once, in the order first met."""
        seen: list[str] = []
        for sample in self.samples:
            seen += [v for v in sample.versions if v not in seen]
        return seen


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
    bytes_sent: int = Field(description="bytes this client sent: each file once per relay chain")
    relay_chains: list[list[str]] = Field(
        default_factory=list, description="the endpoints each copy the client sent went through: the first "
        "received it from the client, each passed it on to the next (one endpoint per chain: a direct push)")
    upload_s: float = Field(description="opening the uploads and sending every file")
    load_s: float = Field(description="the commits (checks and load on the servers) until every endpoint serves it")
    seconds: float = Field(description="the whole push")

    @property
    def mb_per_s(self) -> float:
        """The client's upload rate, in MB/s (10^6 bytes)."""
        return self.bytes_sent / 1e6 / max(self.upload_s, 1e-9)


StalePolicy = Literal["restart", "drop"]
"""What a partial rollout does with a sample past its staleness bound: send it again from its prompt under the
newest weights (``restart``), or give up its whole group (``drop``) and start the next prompt instead."""


class PartialRolloutStats(BaseModel):
    """What a partial rollout (`AsyncRolloutClient.partial_rollout`) has done so far, counted since it started."""

    batches: int = 0
    groups_started: int = Field(default=0, description="prompts taken from the prompts iterable")
    groups_returned: int = 0
    samples_returned: int = 0
    tokens_returned: int = 0
    carried_over: int = Field(default=0, description="samples still generating when a batch was returned, summed "
                              "over batches (they go on into the next step)")
    mixed_version_samples: int = Field(default=0, description="samples returned whose tokens span more than one "
                                       "weight version")
    max_staleness_returned: int = Field(default=0, description="the largest staleness of a sample returned")
    restarted_stale: int = Field(default=0, description="samples sent again from their prompt: past max_staleness")
    restarted_aborted: int = Field(default=0, description="samples sent again from their prompt: they came back "
                                   "aborted (a weight update with in_flight='abort', /admin/abort_rollout)")
    groups_dropped: int = Field(default=0, description="groups given up: past max_staleness with on_stale='drop'")
    groups_failed: int = Field(default=0, description="groups given up because a sample failed after its retries")
    discarded_tokens: int = Field(default=0, description="generated tokens the client received and threw away "
                                  "(restarted samples, the finished samples of dropped or failed groups)")
    cancelled_requests: int = Field(default=0, description="requests in flight the client cancelled (their group "
                                    "was dropped or failed, or the rollout closed); the tokens they had generated "
                                    "are not known to the client and not in discarded_tokens")
