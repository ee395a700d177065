"""A vLLM stat logger that turns the engine's own per-step statistics into samrollout metrics.

vLLM hands every engine step's `SchedulerStats` (running/waiting, `SpecDecodingStats`) and
`IterationStats` (tokens, first-token times, finished requests) to the stat loggers given
to the engine, so acceptance is counted once, by the engine that verified the drafts,
not re-derived from what we proposed.  vLLM's own ``vllm:*`` metrics stay as they are.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from samrollout.metrics import definitions as m


class SamStatLogger(StatLoggerBase):
    """Feeds `samrollout.metrics.definitions` from the engine's stats (one instance per engine)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.drafted = 0
        self.accepted = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        """One engine step's statistics."""
        if scheduler_stats is not None:
            m.REQUESTS_RUNNING.set(scheduler_stats.num_running_reqs)
            m.REQUESTS_WAITING.set(scheduler_stats.num_waiting_reqs)
            if scheduler_stats.spec_decoding_stats is not None:
                self._record_speculation(scheduler_stats.spec_decoding_stats)
            self._record_prefilled_again(getattr(scheduler_stats, "prefix_cache_stats", None))
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_speculation(self, spec: Any) -> None:
        if spec.num_drafts == 0:
            return
        m.SPEC_DRAFTS.inc(spec.num_drafts)
        m.SPEC_DRAFT_TOKENS.inc(spec.num_draft_tokens)
        m.SPEC_ACCEPTED_TOKENS.inc(spec.num_accepted_tokens)
        self._record_positions(spec)
        m.SPEC_ACCEPTANCE_LENGTH.observe(1.0 + spec.num_accepted_tokens / spec.num_drafts)
        self.drafted += spec.num_draft_tokens
        self.accepted += spec.num_accepted_tokens
        m.SPEC_ACCEPTANCE_RATE.set(self.accepted / self.drafted if self.drafted else 0.0)

    @staticmethod
    def _record_prefilled_again(cache: Any) -> None:
        """Tokens prefilled again for preempted sequences re-admitted this step: the scheduler's prefix-cache
        lookups for them (vLLM counts them apart, ``preempted_queries``, and exports none of it) minus the hits.

        vLLM's own ``vllm:prompt_tokens`` counts a request's first prefill only, and its prefix-cache
        counters new requests only: this is the engine's one count of recomputed context.
        """
        queried = int(getattr(cache, "preempted_queries", 0) or 0)
        hits = int(getattr(cache, "preempted_hits", 0) or 0)
        if queried > hits:
            m.PREFILLED_AGAIN.inc(queried - hits)

    @staticmethod
    def _record_positions(spec: Any) -> None:
        """Draft and accepted tokens by draft position.

        vLLM 0.23 counts accepted tokens by position only (no ``num_draft_tokens_per_pos``; drafts
        may be shorter than k, so the drafted counts cannot be derived): there the drafted series
        stays empty.
        """
        accepted_per_pos: list[int] = spec.num_accepted_tokens_per_pos
        drafted_per_pos: list[int] | None = getattr(spec, "num_draft_tokens_per_pos", None)
        if drafted_per_pos is None:
            for position, accepted in enumerate(accepted_per_pos):
                if accepted:
                    m.SPEC_ACCEPTED_BY_POSITION.labels(position=str(position)).inc(accepted)
            return
        for position, (drafted, accepted) in enumerate(zip(drafted_per_pos, accepted_per_pos, strict=True)):
            if drafted:
                m.SPEC_DRAFT_TOKENS_BY_POSITION.labels(position=str(position)).inc(drafted)
                m.SPEC_ACCEPTED_BY_POSITION.labels(position=str(position)).inc(accepted)

    @staticmethod
    def _record_iteration(stats: Any) -> None:
        if stats.num_generation_tokens:
            m.GENERATED_TOKENS.inc(stats.num_generation_tokens)
        if getattr(stats, "num_preempted_reqs", 0):
            m.PREEMPTIONS.inc(stats.num_preempted_reqs)
        for ttft in stats.time_to_first_tokens_iter:
            m.TIME_TO_FIRST_TOKEN.observe(ttft)
        for finished in stats.finished_requests:
            m.REQUEST_LATENCY.observe(finished.e2e_latency)
            m.ENGINE_QUEUE.observe(getattr(finished, "queued_time", 0.0))
            m.PROMPT_TOKENS.observe(finished.num_prompt_tokens)
            m.OUTPUT_TOKENS.observe(finished.num_generation_tokens)
            if finished.num_generation_tokens > 1:
                m.TIME_PER_OUTPUT_TOKEN.observe(finished.mean_time_per_output_token)
            m.REQUESTS_FINISHED.labels(finish_reason=str(finished.finish_reason)).inc()

    def log_engine_initialized(self) -> None:
        """Nothing to log: the metrics are scraped."""
