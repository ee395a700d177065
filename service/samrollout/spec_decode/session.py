"""The per-step drafting logic, free of any engine: one `DraftSession` drives the native drafter.

The vLLM proposer (`samrollout.spec_decode.proposer.SamProposer`) adapts vLLM's batch to
`StepRow`s; the replay and the rollout simulator build the same rows from recorded tokens.  So
what a replay or a simulation reports is, by construction, what the engine's proposer does:
catching up with each request's tokens (or rebuilding a sequence that got shorter), groups,
joining earlier responses (the cross-epoch history), the threshold / draft-range gate, confident
drafts past it, critical-path drafts for the longest-running rows, and the acceptance accounting.

A step takes every row of the batch (rows that only prefilled carry ``sampled == 0`` and get no
draft) and the ids of every request still in the batch; requests absent from it are freed (their
responses join the history).  Time comes from ``now`` (seconds; the engine passes its clock, a
simulator its simulated time), which the adaptive gate turns into step times.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from samrollout.config import SpeculationConfig
from samrollout.drafter import DRAFT_SOURCES, DraftSourceName, SamDrafter, StepDrafts, source_name
from samrollout.history import ResponseHistory
from samrollout.spec_decode.gate import Gate, make_gate
from samrollout.spec_decode.goodput import GoodputPolicy, critical_weights, longest_rows
from samrollout.spec_decode.stats import STEP_SECONDS_BUCKETS, HistoryStats, ProposerStats, SourceCounts
from samrollout.spec_decode.step_cost import StepCost, cost_shape
from samrollout_client.protocol.prompt_identity import prompt_digest, prompt_group

TokenRow = Sequence[int] | npt.NDArray[Any]
# Group arrivals remembered by (rollout id, group), so that each is counted once (`DraftSession._count_arrival`).
MAX_COUNTED_GROUPS = 1 << 16


@dataclass(frozen=True)
class StepRow:
    """One row of an engine step: a request and its whole sequence so far.

    ``tokens`` holds at least ``length`` tokens (prompt then output; only the first ``length``
    are read); ``sampled``: tokens the step just finished produced for it (0: it only prefilled);
    ``group``: its sibling group (None: none, or grouped by prompt when the history is on);
    ``greedy``: temperature 0; ``seeded``: it samples with its own seed; ``room``: most draft
    tokens its context still has room for; ``rollout``: its rollout id (None: none), by which a
    group's arrival is counted once per rollout.
    """

    request_id: Hashable
    sampled: int
    tokens: TokenRow
    length: int
    prompt_length: int
    group: str | None = None
    greedy: bool = True
    room: int = 1 << 30
    seeded: bool = False
    rollout: str | None = None


@dataclass(frozen=True)
class SessionSettings:
    """What a session needs beyond the config: the largest draft vLLM verifies (``largest_draft``),
    the confident drafts' length past the threshold, the hardware, vLLM's batch-size schedule (if the
    engine has one), whether sampled requests get drafts, and whether seeded sampled ones do
    (a seeded request's output follows its drafts, which depend on what else ran: without
    drafts it is the same for the same seed, whatever the load)."""

    largest_draft: int
    confident_k: int
    on_cpu: bool = False
    schedule: tuple[int, ...] | None = None
    draft_sampled: bool = True
    draft_seeded: bool = True

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for draft logs)."""
        return {"largest_draft": self.largest_draft, "confident_k": self.confident_k, "on_cpu": self.on_cpu,
                "schedule": None if self.schedule is None else list(self.schedule),
                "draft_sampled": self.draft_sampled, "draft_seeded": self.draft_seeded}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionSettings:
        """The inverse of `as_dict`."""
        schedule = data.get("schedule")
        return cls(int(data["largest_draft"]), int(data["confident_k"]), bool(data["on_cpu"]),
                   None if schedule is None else tuple(int(x) for x in schedule), bool(data["draft_sampled"]),
                   bool(data.get("draft_seeded", True)))


@dataclass
class _Counters:
    """What the session proposed and what came back accepted, for metrics, benches and tests."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    sampled_rows_skipped: int = 0
    seeded_rows_skipped: int = 0
    confident_drafts: int = 0  # rows drafted past the threshold on a long match (confident_match)
    longest_confident_draft: int = 0
    critical_drafts: int = 0  # rows drafted as the critical path (critical_rows), beyond the range
    history_joined_responses: int = 0
    history_groups: int = 0      # groups that arrived with the history on
    history_hit_groups: int = 0  # of them, those whose prompt had earlier responses in the history
    propose_seconds: float = 0.0
    step_seconds_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1))
    steps_by_batch_size: Counter[int] = field(default_factory=Counter)
    drafting_steps_by_batch_size: Counter[int] = field(default_factory=Counter)
    source_draft_tokens: dict[DraftSourceName, int] = field(default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))
    source_accepted_tokens: dict[DraftSourceName, int] = field(
        default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))


@dataclass
class _Indexed:
    """What one step indexed: the rows to draft for (request ids, their new tokens, their positions in the
    batch), and whether a sequence was added whole (the step also prefilled)."""

    ids: list[Hashable] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    added: bool = False


class DraftSession:
    """SAM drafts for the rows of successive engine steps (see the module docstring)."""

    def __init__(self, config: SpeculationConfig, vocab_size: int, settings: SessionSettings) -> None:
        self.config = config
        self.settings = settings
        self.k = settings.largest_draft
        self.confident_k = min(settings.confident_k, settings.largest_draft)
        # The adaptive policy weighs short matches itself: "auto" keeps every match there.
        self.policy = config.policy.for_hardware(on_cpu=settings.on_cpu and config.threshold_mode != "adaptive")
        self.drafter = SamDrafter(vocab_size, self.policy)
        self.schedule = list(settings.schedule) if settings.schedule is not None else None
        self.gate: Gate = make_gate(config, self.schedule)
        # The adaptive policy: each row's draft length from expected goodput (`samrollout.spec_decode.goodput`).
        self.goodput = (GoodputPolicy(self.k, StepCost(cost_shape(config.cost_prior)))
                        if config.threshold_mode == "adaptive" else None)
        self._last_context = 0.0  # the mean context of the rows drafted for at the last step
        # Cross-epoch history (SpeculationConfig.history_tokens): earlier responses per prompt join a
        # group's automaton at the group's first step that may draft (in the tail, so few groups ever pay).
        self.history = (ResponseHistory(config.history_tokens, config.history_responses)
                        if config.history_tokens > 0 and config.group_drafting else None)
        self._indexed: dict[Hashable, int] = {}      # tokens each request's automaton holds
        self._greedy: dict[Hashable, bool] = {}      # each request's sampling, as its rows said
        self._group: dict[Hashable, str] = {}        # each request's group (requests in none are absent)
        self._prompt_key: dict[Hashable, bytes] = {}  # each request's history key (history on)
        self._unjoined: dict[str, bytes] = {}        # live groups whose history has not joined yet
        self._counted: OrderedDict[tuple[str, str], None] = OrderedDict()  # (rollout, group) arrivals counted
        self._last_draft: dict[Hashable, int] = {}   # length of each request's previous draft
        self._last_source: dict[Hashable, DraftSourceName] = {}  # and where it came from
        self._last_call: float | None = None
        self.counters = _Counters()
        self.last_step_drafted = False
        self.last_step_allowed = False
        # The rows the drafter drafted for at the last step and what it proposed, before the gate (benches).
        self.last_proposal: tuple[list[Hashable], StepDrafts] | None = None

    # -- the step -----------------------------------------------------------------------
    def step(self, rows: Sequence[StepRow], present: Collection[Hashable], now: float | None = None,
             k: int | None = None) -> list[list[int]]:
        """Index every row's new tokens and draft for the rows the gate allows; one draft per row.

        ``present``: every request id still in the batch (others are freed first); ``now``: the
        clock in seconds (default: `time.perf_counter`); ``k``: the largest draft this step (default
        the session's, vLLM's num_speculative_tokens).  In phases: index, let the gate see the step
        just finished, draft, record.
        """
        started = time.perf_counter()
        now = started if now is None else now
        largest = self.k if k is None else k
        running = sum(1 for row in rows if row.sampled)
        self._forget_departed(present)
        indexed = self._index(rows)
        # A step that also prefilled (partial, new or resumed) is no decode step: its time is not the cost model's.
        decode_step = self._last_call is not None and running == len(rows) and not indexed.added
        if self.goodput is not None and decode_step:
            self._learn(indexed, now)
        drafts, sources, step_allowed = self._draft(rows, indexed, running, largest)
        self._record(indexed, drafts, sources, running, step_allowed)
        self._last_call = now
        elapsed = time.perf_counter() - started
        self.counters.propose_seconds += elapsed
        self.counters.step_seconds_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, elapsed)] += 1
        return drafts

    def _index(self, rows: Sequence[StepRow]) -> _Indexed:
        """Every sampled row's tokens since the last step into its automaton (a new or shrunk sequence added
        whole); the rows to draft for, in order."""
        indexed = _Indexed()
        for index, row in enumerate(rows):
            if not row.sampled:
                continue  # partial prefill: nothing sampled, nothing to draft
            self._account(row.request_id, row.sampled)
            seen = self._indexed.get(row.request_id)
            if seen is not None and seen > row.length:  # the sequence shrank: rebuild it
                self.finish(row.request_id)
                seen = None
            if seen is None:
                indexed.added = True
                self._add(row)
                seen = row.prompt_length
            self._greedy[row.request_id] = row.greedy
            indexed.ids.append(row.request_id)
            indexed.new_tokens.append(np.asarray(row.tokens[seen:row.length]).tolist())
            indexed.rows.append(index)
            self._indexed[row.request_id] = row.length
        return indexed

    def _draft(self, rows: Sequence[StepRow], indexed: _Indexed, running: int,
               largest: int) -> tuple[list[list[int]], list[DraftSourceName | None], bool]:
        """The drafter's proposals for the indexed rows, kept where the rules allow (the gate's range, confident
        drafts past it, the critical path); the drafts per row, their sources, whether the gate allowed the step."""
        ids, drafted_rows, counters = indexed.ids, indexed.rows, self.counters
        drafts: list[list[int]] = [[] for _ in rows]
        self.last_proposal = None
        if self.goodput is not None:
            return self._draft_for_goodput(rows, indexed, largest, drafts)
        step_allowed = bool(ids) and self.gate.allow_step(running)
        # Earlier responses join a group before its first step that may draft: past the threshold
        # too when long matches draft there (they are most of what confident drafts match).
        if (step_allowed or self.config.confident_match) and self._unjoined:
            self._join_history(ids)
        if not ids:
            return drafts, [], step_allowed
        proposal = self.drafter.step(ids, indexed.new_tokens, largest)
        self.last_proposal = (ids, proposal)
        proposed = proposal.tokens
        if step_allowed:
            self._keep(drafts, drafted_rows, proposed, self.gate.draft_limit(running, largest), rows)
        elif self.config.confident_match and any(proposed):
            # Past the threshold only drafts with long evidence: a long match is accepted
            # nearly in full, so it pays even where a step is compute-bound.
            confident = [draft if match >= self.config.confident_match else []
                         for draft, match in zip(proposed, proposal.match_lengths, strict=True)]
            counters.confident_drafts += self._keep(drafts, drafted_rows, confident,
                                                    min(self.confident_k, largest), rows)
            counters.longest_confident_draft = max([counters.longest_confident_draft, *map(len, drafts)])
        if self.config.critical_rows:
            counters.critical_drafts += self._keep_critical(drafts, drafted_rows, proposed, largest, rows)
        return drafts, proposal.sources, step_allowed

    def _learn(self, indexed: _Indexed, now: float) -> None:
        """The adaptive policy learns the step just finished (a decode step): its time against the tokens it
        verified.  (How each row's candidates fared is scored in the native step.)"""
        assert self.goodput is not None
        if self._last_call is not None and indexed.ids:
            verified = len(indexed.ids) + sum(self._last_draft.get(r, 0) for r in indexed.ids)
            self.goodput.cost.observe(len(indexed.ids), verified, self._last_context, now - self._last_call)

    def _draft_for_goodput(self, rows: Sequence[StepRow], indexed: _Indexed, largest: int,
                           drafts: list[list[int]]) -> tuple[list[list[int]], list[DraftSourceName | None], bool]:
        """The adaptive policy (`samrollout.spec_decode.goodput`): each row's source and draft length."""
        assert self.goodput is not None
        ids, drafted_rows = indexed.ids, indexed.rows
        if self._unjoined:
            self._join_history(ids)
        if not ids:
            return drafts, [], False
        limits = [self._row_limit(rows[i]) for i in drafted_rows]
        weights = np.ones(len(ids))
        if self.config.critical_rows:
            weights = critical_weights([rows[i].length - rows[i].prompt_length for i in drafted_rows],
                                       self.config.critical_rows, self.config.critical_weight)
        self._last_context = sum(rows[i].length for i in drafted_rows) / len(drafted_rows)
        chosen = self.goodput.step(self.drafter, ids, indexed.new_tokens, [self._greedy[r] for r in ids], limits,
                                   weights, self._last_context)
        sources = [source_name(int(code)) for code in chosen.sources]
        for j, i in enumerate(drafted_rows):
            if chosen.lengths[j]:
                drafts[i] = chosen.drafts[j, :chosen.lengths[j]].tolist()
        return drafts, sources, bool(chosen.lengths.any())

    def _row_limit(self, row: StepRow) -> int:
        """The most draft tokens a row may get this step (0: none): its context's room, or none for a sampled row
        where sampled rows get none (counted as skipped)."""
        if row.room <= 0:
            return 0
        if not row.greedy and not self.settings.draft_sampled:
            self.counters.sampled_rows_skipped += 1
            return 0
        if not row.greedy and row.seeded and not self.settings.draft_seeded:
            self.counters.seeded_rows_skipped += 1
            return 0
        return row.room

    def _record(self, indexed: _Indexed, drafts: list[list[int]], sources: list[DraftSourceName | None],
                running: int, step_allowed: bool) -> None:
        """Each row's draft remembered for its outcome next step (`_account`), and the step counted."""
        counters = self.counters
        for request_id, i, source in zip(indexed.ids, indexed.rows, sources, strict=True):
            self._last_draft[request_id] = len(drafts[i])
            counters.draft_tokens += len(drafts[i])
            if drafts[i] and source is not None:
                self._last_source[request_id] = source
                counters.source_draft_tokens[source] += len(drafts[i])
        counters.steps += 1
        self.last_step_allowed = step_allowed
        self.last_step_drafted = any(drafts)
        counters.steps_by_batch_size[running] += 1
        if self.last_step_drafted:
            counters.drafting_steps_by_batch_size[running] += 1

    def _keep(self, drafts: list[list[int]], drafted_rows: list[int],
              proposed: list[list[int]], limit: int, rows: Sequence[StepRow]) -> int:
        """Put the rows' drafts the rules allow into ``drafts`` (cut to ``limit`` and the context); how many."""
        kept = 0
        for i, draft in zip(drafted_rows, proposed, strict=True):
            room = min(limit, rows[i].room)
            if not draft or room <= 0:
                continue
            if not rows[i].greedy and not self.settings.draft_sampled:
                self.counters.sampled_rows_skipped += 1
                continue
            if not rows[i].greedy and rows[i].seeded and not self.settings.draft_seeded:
                self.counters.seeded_rows_skipped += 1
                continue
            drafts[i] = draft[:room]
            kept += 1
        return kept

    def _keep_critical(self, drafts: list[list[int]], drafted_rows: list[int],
                       proposed: list[list[int]], largest: int, rows: Sequence[StepRow]) -> int:
        """The ``critical_rows`` rows that have run longest draft up to ``critical_k``: only rows whose output
        is longer than every row left out (rows that started together are no evidence); how many got a
        longer draft than the range gave them."""
        chosen = longest_rows([rows[i].length - rows[i].prompt_length for i in drafted_rows], self.config.critical_rows)
        chosen = [j for j in chosen if len(proposed[j]) > len(drafts[drafted_rows[j]])]
        if not chosen:
            return 0
        return self._keep(drafts, [drafted_rows[j] for j in chosen],
                          [proposed[j] for j in chosen], min(self.config.critical_k, largest), rows)

    def _account(self, request_id: Hashable, sampled: int) -> None:
        """The previous draft's outcome: sampled = accepted + 1 bonus token."""
        drafted = self._last_draft.get(request_id, 0)
        if drafted:
            accepted = min(sampled - 1, drafted)
            self.counters.accepted_tokens += accepted
            source = self._last_source.get(request_id)
            if source is not None:
                self.counters.source_accepted_tokens[source] += accepted

    # -- requests, groups and history -----------------------------------------------------
    def _add(self, row: StepRow) -> None:
        group = row.group if self.config.group_drafting else None
        prompt = np.asarray(row.tokens[:row.prompt_length])
        if self.history is not None:
            key = self._prompt_key[row.request_id] = prompt_digest(prompt)
            group = group if group is not None else prompt_group(key)
            if not self.drafter.has_group(group):
                earlier = bool(self.history.responses(key))
                self._count_arrival(group, row.rollout, earlier)
                if earlier:
                    self._unjoined[group] = key
        # A request with another group's id but not its prompt drafts alone (SamDrafter.add_request).
        if self.drafter.add_request(row.request_id, prompt, group=group) and group is not None:
            self._group[row.request_id] = group

    def _count_arrival(self, group: str, rollout: str | None, earlier: bool) -> None:
        """Count a group whose first request arrives, and whether its prompt had ``earlier`` responses in the history.

        With a rollout id, once per (rollout, group), although its automaton may be freed between siblings
        (a length-aware probe that ended before its siblings started); without one, each time it starts afresh.
        """
        if rollout is not None:
            seen = (rollout, group)
            if seen in self._counted:
                self._counted.move_to_end(seen)
                return
            self._counted[seen] = None
            if len(self._counted) > MAX_COUNTED_GROUPS:
                self._counted.popitem(last=False)
        self.counters.history_groups += 1
        self.counters.history_hit_groups += earlier

    def _join_history(self, request_ids: list[Hashable]) -> None:
        """Earlier responses join the groups of these rows that have not had theirs yet."""
        for request_id in request_ids:
            group = self._group.get(request_id)
            key = self._unjoined.pop(group, None) if group is not None else None
            if key is None or self.history is None:
                continue
            for response in self.history.responses(key, exclude=request_id):  # oldest first: the newest is "recent"
                if self.drafter.add_to_group(group, response):  # False past the group's token bound: left out
                    self.counters.history_joined_responses += 1

    def remember(self, prompt: TokenRow, responses: Sequence[TokenRow], ids: Sequence[Hashable]) -> None:
        """Responses an earlier rollout gave to ``prompt`` (ids of their own): into the history, and into
        the global index where it is on, as if this session had served them."""
        if self.history is not None:
            key = prompt_digest(prompt)
            for response_id, response in zip(ids, responses, strict=True):
                self.history.record(key, response_id, response)
        if self.policy.max_global_tokens:
            for response in responses:
                self.drafter.add_to_global(response)

    def finish(self, request_id: Hashable) -> None:
        """Free a request (finished, aborted, preempted); its response joins the history."""
        if self.history is not None and request_id in self._prompt_key:
            self.history.record(self._prompt_key.pop(request_id), request_id, self.drafter.response(request_id))
        if request_id in self.drafter:
            self.drafter.remove_request(request_id)
        group = self._group.pop(request_id, None)
        if group is not None and not self.drafter.has_group(group):
            self._unjoined.pop(group, None)
        for table in (self._indexed, self._greedy, self._last_draft, self._last_source):
            table.pop(request_id, None)

    def _forget_departed(self, present: Collection[Hashable]) -> None:
        """Free requests that left the batch."""
        departed = [r for r in self._indexed if r not in present]
        for request_id in departed:
            self.finish(request_id)


    def reset(self) -> None:
        """Drop every request's automaton and what the gate learned (the policy's weights changed); the
        history of earlier responses and the global index stay (they are only drafts), and take the live
        requests' text so far."""
        for request_id in list(self._indexed):
            self.finish(request_id)
        self.gate = make_gate(self.config, self.schedule)
        self._last_call = None

    # -- reporting ------------------------------------------------------------------------
    @property
    def active_requests(self) -> int:
        """Requests whose automata are held now."""
        return len(self._indexed)

    def stats(self) -> ProposerStats:
        """Counters since start (steps, draft tokens proposed and accepted, sampled rows skipped, time),
        the step-time histogram's counts per `STEP_SECONDS_BUCKETS` bound, and the current settings."""
        c = self.counters
        history = self.history
        return ProposerStats(
            steps=c.steps, draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens,
            sampled_rows_skipped=c.sampled_rows_skipped, seeded_rows_skipped=c.seeded_rows_skipped,
            active_requests=self.active_requests,
            confident_match=self.config.confident_match, confident_drafts=c.confident_drafts,
            confident_k=self.confident_k, longest_confident_draft=c.longest_confident_draft,
            critical_rows=self.config.critical_rows, critical_k=self.config.critical_k,
            critical_drafts=c.critical_drafts,
            propose_seconds=c.propose_seconds, step_seconds_counts=tuple(c.step_seconds_counts),
            last_step_drafted=self.last_step_drafted, k=self.k, threshold=self.config.threshold,
            draft_range=self.config.effective_range(), threshold_mode=self.config.threshold_mode,
            policy=self.policy, threshold_from_vllm_schedule=self.schedule is not None,
            steps_by_batch_size=dict(sorted(c.steps_by_batch_size.items())),
            drafting_steps_by_batch_size=dict(sorted(c.drafting_steps_by_batch_size.items())),
            step_cost={} if self.goodput is None else self.goodput.cost.describe(),
            sources={source: SourceCounts(c.source_draft_tokens[source], c.source_accepted_tokens[source])
                     for source in DRAFT_SOURCES},
            global_tokens=self.drafter.global_tokens,
            history=None if history is None else HistoryStats(
                tokens=history.tokens, prompts=history.prompts, max_tokens=history.max_tokens,
                responses_per_prompt=history.responses_per_prompt, joined_responses=c.history_joined_responses,
                groups=c.history_groups, hit_groups=c.history_hit_groups))
