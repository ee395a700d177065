"""The vLLM proposer: SAM drafts for every running request, one native call per step.

Loaded by vLLM through ``speculative_config={"method": "custom_class", "model":
"samrollout.spec_decode.proposer.SamProposer", "num_speculative_tokens": k}``
(`samrollout.engine` builds that for you).  State is kept per vLLM request id: rows
move between steps, requests are preempted and come back, partial prefills give no
sampled token.  The sequence in ``token_ids_cpu`` is the source of truth, so whatever
happened between two steps, a request's automaton is brought up to date by appending
what it has not seen (or rebuilt if the sequence got shorter).
"""

from __future__ import annotations

import bisect
import inspect
import time
from collections import Counter
from typing import Any

import numpy as np

from samrollout.config import ADDITIONAL_CONFIG_KEY, GROUP_FIELD, SpeculationConfig
from samrollout.drafter import DRAFT_SOURCES, DraftSourceName, SamDrafter
from samrollout.history import ResponseHistory, prompt_key
from samrollout.spec_decode.gate import Gate, make_gate
from samrollout.spec_decode.schedule import dense_from_range, dense_schedule

# Upper bounds (seconds) of the proposer's step-time histogram, exported as samrollout_drafter_step_seconds.
STEP_SECONDS_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2)


def find_model_runner() -> Any:
    """The model runner constructing us (vLLM passes only the config; the runner holds the batch).

    Its ``input_batch`` and ``requests`` are read at every step, so they may be created
    after the proposer (as vLLM's GPU and NPU runners do).
    """
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and type(candidate).__name__.endswith("ModelRunner"):
            return candidate
        frame = frame.f_back
    raise RuntimeError("SamProposer must be constructed by a vLLM model runner (custom_class proposer)")


def _by_batch_size(counts: Counter[int]) -> dict[str, int]:
    """Counts keyed by batch size as JSON keys, smallest first."""
    return {str(size): count for size, count in sorted(counts.items())}


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend (drafts are verified by compute-bound CPU steps)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def group_of(request_id: str, extra_args: dict[str, Any] | None) -> str | None:
    """The request's group: the explicit extra_args field, else the parent of an n>1 child.

    vLLM names the children of a request with n > 1 "{index}_{parent id}" and then adds
    "-{8 random characters}" to every internal id.
    """
    if extra_args and extra_args.get(GROUP_FIELD) is not None:
        return str(extra_args[GROUP_FIELD])
    head, _, rest = request_id.partition("_")
    if head.isdigit() and rest:
        parent, dash, suffix = rest.rpartition("-")
        return f"n:{parent if dash and len(suffix) == 8 else rest}"
    return None


class SamProposer:
    """vLLM custom_class proposer backed by the native SAM drafter."""

    def __init__(self, vllm_config: Any, runner: Any | None = None) -> None:
        spec = vllm_config.speculative_config
        extra = vllm_config.additional_config or {}
        settings = dict(extra.get(ADDITIONAL_CONFIG_KEY, {})) if isinstance(extra, dict) else {}
        largest = int(spec.num_speculative_tokens)
        # Past the threshold confident drafts take the configured k, not the tail's longer range: the batch
        # is bigger there and long drafts are accepted less (SpeculationConfig.confident_match).
        self.confident_k = min(int(settings.get("k", largest)), largest)
        settings["k"] = largest
        self.config = SpeculationConfig.from_json(settings)
        self.k = self.config.k
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.policy = self.config.policy.for_hardware(on_cpu=_on_cpu())
        self.drafter = SamDrafter(int(vllm_config.model_config.get_vocab_size()), self.policy)
        # The static threshold (or the draft range) as vLLM's batch-size schedule, where vLLM has
        # one; a draft range is applied here where it has none (schedule.py).
        self.schedule = None
        if self.config.threshold_mode == "static":
            self.schedule = dense_schedule(vllm_config)
            if self.schedule is None and self.config.draft_range is not None:
                self.schedule = dense_from_range(self.config.draft_range)
        self.gate: Gate = make_gate(self.config, self.schedule)
        self.runner = runner if runner is not None else find_model_runner()
        self.draft_sampled = self._draft_sampled(self.config.sampled_requests)
        self._indexed: dict[str, int] = {}       # tokens each request's automaton holds
        # Cross-epoch history (SpeculationConfig.history_tokens): earlier responses per prompt join a
        # group's automaton at the group's first drafting step (in the tail, so few groups ever pay).
        self.history = (ResponseHistory(self.config.history_tokens, self.config.history_responses)
                        if self.config.history_tokens > 0 and self.config.group_drafting else None)
        self._group: dict[str, str] = {}         # each request's group (requests in none are absent)
        self._prompt_key: dict[str, bytes] = {}  # each request's history key (history on)
        self._unjoined: dict[str, bytes] = {}    # live groups whose history has not joined yet
        self.history_joined_responses = 0
        self._last_draft: dict[str, int] = {}    # length of each request's previous draft
        self._last_source: dict[str, DraftSourceName] = {}  # and where it came from
        # Draft tokens proposed (kept) and accepted, by source: own automaton, group's, global index.
        self.source_draft_tokens: dict[DraftSourceName, int] = dict.fromkeys(DRAFT_SOURCES, 0)
        self.source_accepted_tokens: dict[DraftSourceName, int] = dict.fromkeys(DRAFT_SOURCES, 0)
        self._last_call: float | None = None
        # Counters for metrics and tests: what we proposed, what came back accepted.
        self.steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.sampled_rows_skipped = 0
        self.confident_drafts = 0  # rows drafted past the threshold on a long match (confident_match)
        self.longest_confident_draft = 0  # tokens (at most confident_k)
        self.propose_seconds = 0.0
        self.step_seconds_counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)  # last: above every bound
        self.last_step_drafted = False
        # Steps (and those that drafted) by batch size: requests that sampled a token in the step.
        self.steps_by_batch_size: Counter[int] = Counter()
        self.drafting_steps_by_batch_size: Counter[int] = Counter()

    @staticmethod
    def _draft_sampled(mode: str) -> bool:
        if mode != "auto":
            return mode == "draft"
        return not _on_cpu()

    def stats(self) -> dict[str, Any]:
        """Counters since start (steps, draft tokens proposed and accepted, sampled rows skipped, time),
        the step-time histogram's counts per `STEP_SECONDS_BUCKETS` bound, and the current settings."""
        return {"steps": self.steps, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "sampled_rows_skipped": self.sampled_rows_skipped, "active_requests": self.active_requests,
                "confident_match": self.config.confident_match, "confident_drafts": self.confident_drafts,
                "confident_k": self.confident_k, "longest_confident_draft": self.longest_confident_draft,
                "propose_seconds": self.propose_seconds, "step_seconds_counts": list(self.step_seconds_counts),
                "last_step_drafted": self.last_step_drafted, "k": self.k, "threshold": self.config.threshold,
                "draft_range": [list(pair) for pair in self.config.effective_range()],
                "threshold_mode": self.config.threshold_mode, "policy": self.policy.as_dict(),
                "threshold_from_vllm_schedule": self.schedule is not None,
                "steps_by_batch_size": _by_batch_size(self.steps_by_batch_size),
                "drafting_steps_by_batch_size": _by_batch_size(self.drafting_steps_by_batch_size),
                "gate": self.gate.summary(),
                "sources": {source: {"draft_tokens": self.source_draft_tokens[source],
                                     "accepted_tokens": self.source_accepted_tokens[source]}
                            for source in DRAFT_SOURCES},
                "global_tokens": self.drafter.global_tokens,
                "history": None if self.history is None else {
                    "tokens": self.history.tokens, "prompts": self.history.prompts,
                    "max_tokens": self.history.max_tokens, "responses_per_prompt": self.history.responses_per_prompt,
                    "joined_responses": self.history_joined_responses}}

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: the drafter is model-free."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Index every row's new tokens and draft for the rows the gate allows."""
        now = time.perf_counter()
        batch = self.runner.input_batch
        req_ids: list[str] = list(batch.req_ids)
        rows = len(sampled_token_ids)
        running = sum(1 for s in sampled_token_ids if s)
        self._forget_departed(set(batch.req_id_to_index))
        # Did the step just finished also prefill (a partial prefill, or a new or resumed request)?
        prefilled = running < rows

        ids: list[str] = []
        new_tokens: list[list[int]] = []
        row_of: list[int] = []
        for i in range(rows):
            sampled = sampled_token_ids[i]
            if not sampled:
                continue  # partial prefill: nothing sampled, nothing to draft
            request_id = req_ids[i]
            self._account(request_id, len(sampled))
            length = int(num_tokens_no_spec[i])
            seen = self._indexed.get(request_id)
            if seen is not None and seen > length:  # the sequence shrank: rebuild it
                self._remove(request_id)
                seen = None
            if seen is None:
                prefilled = True
                prompt_length = int(batch.num_prompt_tokens[i])
                self._add(request_id, token_ids_cpu[i, :prompt_length])
                seen = prompt_length
            ids.append(request_id)
            new_tokens.append(token_ids_cpu[i, seen:length].tolist())
            row_of.append(i)
            self._indexed[request_id] = length

        if self._last_call is not None and not prefilled:
            produced = sum(len(sampled) for sampled in sampled_token_ids)
            self.gate.observe_step(running, self.last_step_drafted, now - self._last_call, produced)

        drafts: list[list[int]] = [[] for _ in range(rows)]
        step_allowed = bool(ids) and self.gate.allow_step(running)
        # Earlier responses join a group before its first step that may draft: past the threshold
        # too when long matches draft there (they are most of what confident drafts match).
        if (step_allowed or self.config.confident_match) and self._unjoined:
            self._join_history(ids)
        if ids:
            proposed = self.drafter.step(ids, new_tokens, self.k)
            if step_allowed:
                self._keep(drafts, ids, row_of, proposed, self.gate.draft_limit(running, self.k), num_tokens_no_spec)
            elif self.config.confident_match and any(proposed):
                # Past the threshold only drafts with long evidence: a long match is accepted
                # nearly in full, so it pays even where a step is compute-bound.
                evidence = self.drafter.last_match_lengths(ids)
                confident = [draft if match >= self.config.confident_match else []
                             for draft, match in zip(proposed, evidence, strict=True)]
                self.confident_drafts += self._keep(drafts, ids, row_of, confident, self.confident_k,
                                                    num_tokens_no_spec)
                self.longest_confident_draft = max([self.longest_confident_draft, *map(len, drafts)])
        drafted_rows = [(request_id, i) for request_id, i in zip(ids, row_of, strict=True) if drafts[i]]
        sources = self.drafter.last_sources([request_id for request_id, _ in drafted_rows]) if drafted_rows else []
        for request_id, i in zip(ids, row_of, strict=True):
            self._last_draft[request_id] = len(drafts[i])
            self.draft_tokens += len(drafts[i])
        for (request_id, i), source in zip(drafted_rows, sources, strict=True):
            if source is not None:
                self._last_source[request_id] = source
                self.source_draft_tokens[source] += len(drafts[i])
        self.steps += 1
        self.last_step_drafted = any(drafts)
        self.steps_by_batch_size[running] += 1
        if self.last_step_drafted:
            self.drafting_steps_by_batch_size[running] += 1
        self._last_call = time.perf_counter()
        elapsed = self._last_call - now
        self.propose_seconds += elapsed
        self.step_seconds_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, elapsed)] += 1
        return drafts

    def _keep(self, drafts: list[list[int]], ids: list[str], row_of: list[int], proposed: list[list[int]],
              limit: int, num_tokens_no_spec: np.ndarray) -> int:
        """Put the rows' drafts the rules allow into ``drafts`` (cut to ``limit`` and the context); how many."""
        kept = 0
        for request_id, i, draft in zip(ids, row_of, proposed, strict=True):
            room = min(limit, self.max_model_len - int(num_tokens_no_spec[i]) - 1)
            if not draft or room <= 0 or not self.gate.allow_request(request_id):
                continue
            if not self.draft_sampled and not self._greedy(request_id):
                self.sampled_rows_skipped += 1
                continue
            drafts[i] = draft[:room]
            kept += 1
        return kept

    def _account(self, request_id: str, sampled: int) -> None:
        """The previous draft's outcome: sampled = accepted + 1 bonus token."""
        drafted = self._last_draft.get(request_id, 0)
        if drafted:
            accepted = min(sampled - 1, drafted)
            self.accepted_tokens += accepted
            source = self._last_source.get(request_id)
            if source is not None:
                self.source_accepted_tokens[source] += accepted
            self.gate.observe_request(request_id, drafted, accepted)

    def _greedy(self, request_id: str) -> bool:
        params = getattr(self.runner.requests.get(request_id), "sampling_params", None)
        return params is not None and params.temperature < 1e-5

    def _add(self, request_id: str, prompt: np.ndarray) -> None:
        group = None
        if self.config.group_drafting:
            state = self.runner.requests.get(request_id)
            params = getattr(state, "sampling_params", None)
            group = group_of(request_id, getattr(params, "extra_args", None))
        if self.history is not None:
            key = self._prompt_key[request_id] = prompt_key(prompt)
            group = group if group is not None else f"prompt:{key.hex()}"
            if not self.drafter.has_group(group) and self.history.responses(key):
                self._unjoined[group] = key
        # A request with another group's id but not its prompt drafts alone (SamDrafter.add_request).
        if self.drafter.add_request(request_id, prompt, group=group) and group is not None:
            self._group[request_id] = group

    def _join_history(self, request_ids: list[str]) -> None:
        """Earlier responses join the groups of these rows that have not had theirs yet."""
        for request_id in request_ids:
            group = self._group.get(request_id)
            key = self._unjoined.pop(group, None) if group is not None else None
            if key is None or self.history is None:
                continue
            for response in self.history.responses(key, exclude=request_id):  # oldest first: the newest is "recent"
                if self.drafter.add_to_group(group, response):  # False past the group's token bound: left out
                    self.history_joined_responses += 1

    def _remove(self, request_id: str) -> None:
        if self.history is not None and request_id in self._prompt_key:
            self.history.record(self._prompt_key.pop(request_id), request_id, self.drafter.response(request_id))
        self.drafter.remove_request(request_id)
        group = self._group.pop(request_id, None)
        if group is not None and not self.drafter.has_group(group):
            self._unjoined.pop(group, None)
        self._indexed.pop(request_id, None)
        self._last_draft.pop(request_id, None)
        self._last_source.pop(request_id, None)

    def _forget_departed(self, present: set[str]) -> None:
        """Free requests that left the batch (finished, aborted or preempted)."""
        departed = [r for r in self._indexed if r not in present]
        for request_id in departed:
            self._remove(request_id)
        self.gate.forget(departed)

    def reset(self) -> None:
        """Drop every request's automaton and what the gate learned (the policy's weights changed); the
        history of earlier responses and the global index stay (they are only drafts), and take the live
        requests' text so far."""
        for request_id in list(self._indexed):
            self._remove(request_id)
        self.gate = make_gate(self.config, self.schedule)
        self._last_call = None

    @property
    def active_requests(self) -> int:
        """Requests whose automata are held now."""
        return len(self._indexed)
