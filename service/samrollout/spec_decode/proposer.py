"""The vLLM proposer: an adapter from vLLM's batch to the engine-free `DraftSession`.

Loaded by vLLM through ``speculative_config={"method": "custom_class", "model":
"samrollout.spec_decode.proposer.SamProposer", "num_speculative_tokens": k}``
(`samrollout.engine` builds that for you).  Every step it reads the runner's batch (request
ids, what each row sampled, its sequence in ``token_ids_cpu``, its prompt length, group and
sampling) into `StepRow`s and hands them to the session, which holds all the drafting logic
(`samrollout.spec_decode.session`): the replay and the rollout simulator drive the same session.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, NamedTuple

import numpy as np

from samrollout.config import ADDITIONAL_CONFIG_KEY, GROUP_FIELD, ROLLOUT_FIELD, SpeculationConfig
from samrollout.spec_decode.cpu_sampled_verification import sampled_verification_is_exact
from samrollout.spec_decode.draft_log import DraftLogWriter
from samrollout.spec_decode.schedule import dense_from_range, dense_schedule
from samrollout.spec_decode.session import DraftSession, SessionSettings, StepRow
from samrollout.spec_decode.stats import STEP_SECONDS_BUCKETS, ProposerStats
from samrollout_client.protocol.prompt_identity import sibling_group

__all__ = ["STEP_SECONDS_BUCKETS", "SamProposer", "find_model_runner", "group_of"]


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
        return sibling_group(parent if dash and len(suffix) == 8 else rest)
    return None


class _Facts(NamedTuple):
    """What the proposer reads once from a request's sampling params."""

    group: str | None
    greedy: bool
    seeded: bool
    rollout: str | None


class SamProposer:
    """vLLM custom_class proposer backed by the native SAM drafter, through a `DraftSession`."""

    def __init__(self, vllm_config: Any, runner: Any | None = None) -> None:
        spec = vllm_config.speculative_config
        extra = vllm_config.additional_config or {}
        settings = dict(extra.get(ADDITIONAL_CONFIG_KEY, {})) if isinstance(extra, dict) else {}
        config = SpeculationConfig.from_json(settings)
        # The largest draft is what vLLM verifies (num_speculative_tokens, set from config.largest_draft()); the
        # config's k stays the user's k, the length of confident drafts past the threshold: the batch is bigger
        # there and long drafts are accepted less (SpeculationConfig.confident_match).
        largest = int(spec.num_speculative_tokens)
        confident_k = min(config.k, largest)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        # The static threshold (or the draft range) as vLLM's batch-size schedule, where vLLM has
        # one; a draft range is applied here where it has none (schedule.py).
        schedule = None
        if config.threshold_mode == "static":
            schedule = dense_schedule(vllm_config)
            if schedule is None and config.draft_range is not None:
                schedule = dense_from_range(config.draft_range)
        on_cpu = _on_cpu()
        session_settings = SessionSettings(
            largest_draft=largest, confident_k=confident_k, on_cpu=on_cpu,
            schedule=None if schedule is None else tuple(schedule),
            draft_sampled=self._draft_sampled(config.sampled_requests),
            draft_seeded=config.sampled_requests == "draft")
        vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.session = DraftSession(config, vocab_size, session_settings)
        self.runner = runner if runner is not None else find_model_runner()
        self.log = DraftLogWriter.from_env(config, vocab_size, session_settings)
        self._facts: dict[str, _Facts] = {}  # read once per request

    @staticmethod
    def _draft_sampled(mode: str) -> bool:
        """Whether sampled rows get drafts: "draft" yes, "skip" no, "auto" wherever vLLM verifies them
        exactly (everywhere, vLLM's CPU backend included once the cpu_sampled_verification plugin patched it)."""
        if mode != "auto":
            return mode == "draft"
        return sampled_verification_is_exact()

    @property
    def config(self) -> SpeculationConfig:
        """The speculation settings in force (``k``: the user's; the largest draft vLLM verifies is `k`)."""
        return self.session.config

    @property
    def k(self) -> int:
        """vLLM's num_speculative_tokens: the largest draft."""
        return self.session.k

    def stats(self) -> ProposerStats:
        """The session's counters and settings (`DraftSession.stats`)."""
        return self.session.stats()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: the drafter is model-free."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Read the batch into rows and let the session index and draft them."""
        now = time.perf_counter()
        batch = self.runner.input_batch
        req_ids: list[str] = list(batch.req_ids)
        rows = []
        for i, sampled in enumerate(sampled_token_ids):
            request_id = req_ids[i]
            length = int(num_tokens_no_spec[i])
            facts = self._request_facts(request_id)
            rows.append(StepRow(request_id, len(sampled), token_ids_cpu[i], length, int(batch.num_prompt_tokens[i]),
                                facts.group, facts.greedy, room=self.max_model_len - length - 1,
                                seeded=facts.seeded, rollout=facts.rollout))
        present = list(batch.req_id_to_index)
        if len(self._facts) > 2 * len(present) + 64:  # drop the facts of requests that left
            self._facts = {r: self._facts[r] for r in present if r in self._facts}
        drafts = self.session.step(rows, present, now=now)
        if self.log is not None:
            self.log.write(rows, present, now, drafts)
        return drafts

    def _request_facts(self, request_id: str) -> _Facts:
        """The request's group, sampling, seed and rollout id (its sampling params), read once."""
        facts = self._facts.get(request_id)
        if facts is not None:
            return facts
        params = getattr(self.runner.requests.get(request_id), "sampling_params", None)
        greedy = params is not None and params.temperature < 1e-5
        extra_args = getattr(params, "extra_args", None)
        group = group_of(request_id, extra_args) if self.session.config.group_drafting else None
        seeded = getattr(params, "seed", None) is not None
        rollout = extra_args.get(ROLLOUT_FIELD) if extra_args else None
        facts = self._facts[request_id] = _Facts(group, greedy, seeded, None if rollout is None else str(rollout))
        return facts

    def reset(self) -> None:
        """Drop every request's automaton and what the gate learned (`DraftSession.reset`)."""
        self.session.reset()

    @property
    def active_requests(self) -> int:
        """Requests whose automata are held now."""
        return self.session.active_requests
