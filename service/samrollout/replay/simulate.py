"""Greedy-oracle replay: a draft token is accepted while it equals the true next token.

Every verification step yields the accepted draft tokens plus one bonus token (the
target model's own next token), exactly as speculative decoding does when the
sampled response is the one recorded.  The replay is shaped like a rollout: every
response starts at once and each round is one engine step for all running rows, so
rows finish at different times and the last few long ones form the tail.  The tail is
fixed by the traces, not by the drafter: the positions past the round at which, without
speculation, at most ``tail_rows`` responses would still run.  That is where a
thresholded engine speculates, so its acceptance is reported on its own.

``threshold`` is the engine's static gate.  Our drafters are the engine's own
`DraftSession` (``gates_itself``): it applies the gate, the draft range and confident
drafts itself, exactly as in the engine.  For the others (vLLM's peers, the oracle), in a
round with more running rows than the threshold the drafter still indexes the new tokens
but its drafts are dropped, so the step yields one token.

An oracle (`samrollout.replay.oracle.SourceOracle`) returns, per row, one candidate
draft per source; the step takes the candidate with the longest accepted
prefix, which only a verifier that knows the true continuation can pick.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from samrollout.replay.oracle import SourceOracle
from samrollout.replay.protocol import ReplayDrafter, remember
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
    threshold: int | None = None  # drafts only in rounds with at most this many running rows (None: always)
    drafting_steps: int = 0     # steps in rounds where the gate let the drafter draft
    # Oracle only: its sources, and per source the steps at which it reached the best accepted length
    # (ties count for every tied source), the steps at which it alone gave the best (> 0), and the
    # draft tokens it would have had accepted at the oracle's steps.
    sources: list[str] = field(default_factory=list)
    source_best: list[int] = field(default_factory=list)
    source_only_best: list[int] = field(default_factory=list)
    source_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_by_position = self.accepted_by_position or [0] * self.k
        self.drafted_by_position = self.drafted_by_position or [0] * self.k
        n = len(self.sources)
        self.source_best = self.source_best or [0] * n
        self.source_only_best = self.source_only_best or [0] * n
        self.source_accepted = self.source_accepted or [0] * n

    @property
    def is_oracle(self) -> bool:
        """An oracle's result (best source per step, picked knowing the truth), not a drafter's."""
        return bool(self.sources)

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
    def rejected_per_accepted(self) -> float:
        """Draft tokens verified in vain per draft token accepted (the waste of long drafts; 0 if none accepted)."""
        return (self.drafted - self.accepted) / self.accepted if self.accepted else 0.0

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
        out: dict[str, Any] = {
            "drafter": self.name,
            "oracle": self.is_oracle,
            "k": self.k,
            "drafts_at_most_running": self.threshold,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tail_mean_acceptance_length": self.tail_mean_acceptance_length,
            "tail_rows": self.tail_rows,
            "tail_steps": self.tail_steps,
            "acceptance_rate": self.acceptance_rate,
            "rejected_per_accepted": self.rejected_per_accepted,
            "draft_tokens_per_step": self.drafted / self.steps if self.steps else 0.0,
            "us_per_step": self.us_per_step,
            "us_per_token": self.us_per_token,
            "steps": self.steps,
            "drafting_steps": self.drafting_steps,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate_by_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
            ],
        }
        if self.is_oracle:
            out["sources"] = {
                name: {"best_steps": best, "only_best_steps": only, "accepted": accepted}
                for name, best, only, accepted in zip(self.sources, self.source_best, self.source_only_best,
                                                      self.source_accepted, strict=True)
            }
        return out


def accepted_length(draft: Sequence[int], truth: list[int], pos: int, k: int) -> int:
    """How many leading draft tokens (at most k) equal the recorded continuation at ``pos``."""
    n = 0
    for token in draft[:k]:
        if pos + n >= len(truth) or int(token) != truth[pos + n]:
            break
        n += 1
    return n


@dataclass
class _Rows:
    """The responses of one replay still running: each one's full text, prompt length, true tokens, how far it
    got, and the tokens the drafter has not seen yet."""

    full: dict[int, np.ndarray] = field(default_factory=dict)
    prompt_length: dict[int, int] = field(default_factory=dict)
    truth: dict[int, list[int]] = field(default_factory=dict)
    position: dict[int, int] = field(default_factory=dict)
    pending: dict[int, list[int]] = field(default_factory=dict)


def replay(drafter: ReplayDrafter | SourceOracle, groups: list[TraceGroup], k: int, tail_rows: int = 16,
           threshold: int | None = None, history: Sequence[Sequence[np.ndarray]] | None = None) -> ReplayResult:
    """Replay every response through ``drafter`` as one rollout and count what a greedy verifier accepts.

    ``threshold``: draft only in rounds where at most this many rows run (the engine's static
    gate; None drafts in every round).  ``history[i]``: responses to ``groups[i]``'s prompt from an
    earlier rollout, given first to drafters that keep such (`protocol.remember`; not timed).
    """
    sources = list(drafter.sources) if isinstance(drafter, SourceOracle) else []
    result = ReplayResult(drafter.name, k, tail_rows=tail_rows, threshold=threshold, sources=sources)
    configure = getattr(drafter, "configure", None)
    if configure is not None:
        configure(k, threshold)  # ours: the engine's session, gated as the engine gates
    for group_index, earlier in enumerate(history or []):
        remember(drafter, group_index, groups[group_index].prompt, earlier)
    rows = _admit_all(drafter, groups, result)
    # The first position at which at most tail_rows responses are still unfinished.
    lengths = sorted((len(r) for r in rows.truth.values()), reverse=True)
    tail_start = lengths[tail_rows] if len(lengths) > tail_rows else 0
    self_gated = getattr(drafter, "gates_itself", False)  # ours: the engine's session gates its own drafts
    while rows.position:
        ids = list(rows.position)
        contexts = [rows.full[i][: rows.prompt_length[i] + rows.position[i]] for i in ids]
        new = [rows.pending[i] for i in ids]
        gated = not self_gated and threshold is not None and len(ids) > threshold
        start = time.perf_counter()
        drafts: list[Any]
        if gated and isinstance(drafter, SourceOracle):
            drafter.index(ids, new, contexts, k)  # its drafts would be dropped: only keep the sources current
            drafts = [[] for _ in ids]
        else:
            drafts = drafter.step(ids, new, contexts, k)
        result.step_seconds += time.perf_counter() - start
        result.row_steps += len(ids)
        result.indexed_tokens += sum(len(t) for t in new)
        if (drafter.last_step_allowed if self_gated else not gated):  # type: ignore[union-attr]
            result.drafting_steps += len(ids)
        for seq_id, draft in zip(ids, drafts, strict=True):
            _advance(result, rows, seq_id, draft, gated, k, tail_start)
        for seq_id in [i for i in ids if rows.position[i] >= len(rows.truth[i])]:
            start = time.perf_counter()
            drafter.remove(seq_id)
            result.lifecycle_seconds += time.perf_counter() - start
            del rows.position[seq_id], rows.pending[seq_id]
    return result


def _admit_all(drafter: ReplayDrafter | SourceOracle, groups: list[TraceGroup], result: ReplayResult) -> _Rows:
    """Every response of at least two tokens added to ``drafter`` (its first token came from prefill: nothing to
    speculate on), positioned after that token."""
    rows = _Rows()
    for group_index, group in enumerate(groups):
        for response in group.responses:
            if len(response) < 2:
                continue
            seq_id = len(rows.full)
            start = time.perf_counter()
            drafter.add(seq_id, group_index, group.prompt)
            result.lifecycle_seconds += time.perf_counter() - start
            result.indexed_tokens += len(group.prompt)
            rows.full[seq_id] = np.concatenate([group.prompt, response])
            rows.prompt_length[seq_id] = len(group.prompt)
            rows.truth[seq_id] = response.tolist()
            rows.position[seq_id] = 1
            rows.pending[seq_id] = rows.truth[seq_id][:1]
    return rows


def _advance(result: ReplayResult, rows: _Rows, seq_id: int, draft: Any, gated: bool, k: int,
             tail_start: int) -> None:
    """One response's round: its draft verified (none where the round is ``gated``; with candidate sources, the
    best one), its position moved on by what was accepted plus the bonus token, the tail's counters where it is
    past ``tail_start``."""
    pos = rows.position[seq_id]
    if gated:
        draft = []
    elif result.sources:
        draft = _best_candidate(result, draft, rows.truth[seq_id], pos, k)
    before = result.tokens
    _verify(result, draft, rows.truth[seq_id], pos, k)
    advance = result.tokens - before
    if pos >= tail_start:
        result.tail_steps += 1
        result.tail_tokens += advance
    rows.pending[seq_id] = rows.truth[seq_id][pos: pos + advance]
    rows.position[seq_id] = pos + advance


def _best_candidate(result: ReplayResult, candidates: Sequence[Sequence[int]], truth: list[int], pos: int,
                    k: int) -> Sequence[int]:
    """The oracle's pick: the candidate with the longest accepted prefix (of those, the shortest draft)."""
    lengths = [accepted_length(c, truth, pos, k) for c in candidates]
    best = max(lengths, default=0)
    winners = [i for i, n in enumerate(lengths) if n == best]
    for i, n in enumerate(lengths):
        result.source_accepted[i] += n
    if best > 0:
        for i in winners:
            result.source_best[i] += 1
        if len(winners) == 1:
            result.source_only_best[winners[0]] += 1
    return min((candidates[i] for i in winners), key=len)


def _verify(result: ReplayResult, proposed: Sequence[int], truth: list[int], pos: int, k: int) -> None:
    """Count one verification step of ``proposed`` (cut to k) at ``pos`` of the recorded response."""
    draft = proposed[:k]
    accepted = accepted_length(draft, truth, pos, k)
    result.steps += 1
    result.tokens += min(accepted + 1, len(truth) - pos)
    result.drafted += len(draft)
    result.accepted += accepted
    for i in range(len(draft)):
        result.drafted_by_position[i] += 1
        if i < accepted:
            result.accepted_by_position[i] += 1


def verify_step(result: ReplayResult, seq_id: int, proposed: Sequence[int] | np.ndarray,
                responses: dict[int, np.ndarray], position: dict[int, int], pending: dict[int, list[int]]) -> None:
    """Verify one row's draft (cut to k) against the recorded response and advance the row."""
    response, pos = responses[seq_id], position[seq_id]
    truth = response.tolist() if isinstance(response, np.ndarray) else list(response)
    before = result.tokens
    _verify(result, list(proposed), truth, pos, result.k)
    advance = result.tokens - before
    pending[seq_id] = truth[pos: pos + advance]  # engines hand drafters lists
    position[seq_id] = pos + advance
