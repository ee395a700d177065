"""Greedy-oracle replay: a draft token is accepted while it equals the true next token.

Every verification step yields the accepted draft tokens plus one bonus token (the
target model's own next token), exactly as speculative decoding does when the
sampled response is the one recorded.  The replay is shaped like a rollout: every
response starts at once and each round is one engine step for all running rows, so
rows finish at different times and the last few long ones form the tail.  The tail is
fixed by the traces, not by the drafter: the positions past the round at which, without
speculation, at most ``tail_rows`` responses would still run.  That is where a
thresholded engine speculates, so its acceptance is reported on its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from samrollout.replay.protocol import ReplayDrafter
from samrollout.replay.traces import TraceGroup


@dataclass
class ReplayResult:
    """What one drafter achieved on the traces."""

    name: str
    k: int
    steps: int = 0              # verification steps (decode steps after the first token)
    tokens: int = 0             # tokens those steps produced (accepted + bonus)
    drafted: int = 0            # draft tokens proposed
    accepted: int = 0           # draft tokens accepted
    row_steps: int = 0          # drafter invocations, one per row per step
    indexed_tokens: int = 0     # prompt and output tokens handed to the drafter
    lifecycle_seconds: float = 0.0  # time adding (indexing prompts) and removing
    step_seconds: float = 0.0   # time in the per-step calls
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    tail_steps: int = 0         # verification steps that started at a tail position
    tail_tokens: int = 0
    tail_rows: int = 16

    def __post_init__(self) -> None:
        self.accepted_by_position = self.accepted_by_position or [0] * self.k
        self.drafted_by_position = self.drafted_by_position or [0] * self.k

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step, the bonus token included (1.0: no gain)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tail_mean_acceptance_length(self) -> float:
        """MAL over the tail's steps only (where a thresholded engine speculates)."""
        return self.tail_tokens / self.tail_steps if self.tail_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def us_per_step(self) -> float:
        """Drafter time per row-step (append + propose), microseconds."""
        return 1e6 * self.step_seconds / self.row_steps if self.row_steps else 0.0

    @property
    def us_per_token(self) -> float:
        """Drafter time per token indexed (prompt or output), microseconds."""
        total = self.lifecycle_seconds + self.step_seconds
        return 1e6 * total / self.indexed_tokens if self.indexed_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return {
            "drafter": self.name,
            "k": self.k,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tail_mean_acceptance_length": self.tail_mean_acceptance_length,
            "tail_rows": self.tail_rows,
            "tail_steps": self.tail_steps,
            "acceptance_rate": self.acceptance_rate,
            "draft_tokens_per_step": self.drafted / self.steps if self.steps else 0.0,
            "us_per_step": self.us_per_step,
            "us_per_token": self.us_per_token,
            "steps": self.steps,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate_by_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
            ],
        }


def replay(drafter: ReplayDrafter, groups: list[TraceGroup], k: int, tail_rows: int = 16) -> ReplayResult:
    """Replay every response through ``drafter`` as one rollout and count what a greedy verifier accepts."""
    result = ReplayResult(drafter.name, k, tail_rows=tail_rows)
    full: dict[int, np.ndarray] = {}
    prompt_length: dict[int, int] = {}
    responses: dict[int, np.ndarray] = {}
    position: dict[int, int] = {}
    pending: dict[int, list[int]] = {}
    for group_index, group in enumerate(groups):
        for response in group.responses:
            if len(response) < 2:
                continue  # the first token comes from prefill: nothing to speculate on
            seq_id = len(full)
            start = time.perf_counter()
            drafter.add(seq_id, group_index, group.prompt)
            result.lifecycle_seconds += time.perf_counter() - start
            result.indexed_tokens += len(group.prompt)
            full[seq_id] = np.concatenate([group.prompt, response])
            prompt_length[seq_id] = len(group.prompt)
            responses[seq_id] = response
            position[seq_id] = 1
            pending[seq_id] = response[:1].tolist()
    # The first position at which at most tail_rows responses are still unfinished.
    lengths = sorted((len(r) for r in responses.values()), reverse=True)
    tail_start = lengths[tail_rows] if len(lengths) > tail_rows else 0
    while position:
        ids = list(position)
        contexts = [full[i][: prompt_length[i] + position[i]] for i in ids]
        new = [pending[i] for i in ids]
        start = time.perf_counter()
        drafts = drafter.step(ids, new, contexts, k)
        result.step_seconds += time.perf_counter() - start
        result.row_steps += len(ids)
        result.indexed_tokens += sum(len(t) for t in new)
        for seq_id, draft in zip(ids, drafts, strict=True):
            before, in_tail = result.tokens, position[seq_id] >= tail_start
            verify_step(result, seq_id, draft, responses, position, pending)
            if in_tail:
                result.tail_steps += 1
                result.tail_tokens += result.tokens - before
        for seq_id in [i for i in ids if position[i] >= len(responses[i])]:
            start = time.perf_counter()
            drafter.remove(seq_id)
            result.lifecycle_seconds += time.perf_counter() - start
            del position[seq_id], pending[seq_id]
    return result


def verify_step(result: ReplayResult, seq_id: int, proposed: Sequence[int] | np.ndarray,
                responses: dict[int, np.ndarray], position: dict[int, int], pending: dict[int, list[int]]) -> None:
    """Verify one row's draft (cut to k) against the recorded response and advance the row."""
    draft = np.asarray(proposed, dtype=np.int64)[: result.k]
    response, pos = responses[seq_id], position[seq_id]
    truth = response[pos: pos + len(draft)]
    matches = draft[: len(truth)] == truth
    accepted = int(np.argmin(matches)) if not matches.all() else len(truth)
    advance = min(accepted + 1, len(response) - pos)
    result.steps += 1
    result.tokens += advance
    result.drafted += len(draft)
    result.accepted += accepted
    for i in range(len(draft)):
        result.drafted_by_position[i] += 1
        result.accepted_by_position[i] += int(i < accepted)
    pending[seq_id] = response[pos: pos + advance].tolist()  # engines hand drafters lists
    position[seq_id] = pos + advance
