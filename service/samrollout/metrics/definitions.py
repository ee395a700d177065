"""Every samrollout metric, defined once, in base units (seconds, tokens) and bounded label sets.

The server runs one API process (uvicorn, one worker; vLLM's engine core and workers are
child processes that report through the engine's stats), so the default registry is
enough: no multiprocess mode.  Labels are bounded: positions < k, finish reasons, HTTP
status codes, the one current weight version; never request or rollout ids.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: they double the exposition and no panel reads them
P = "samrollout_"
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_SHARE = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_RATIO = (1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)

# Speculation, from vLLM's SpecDecodingStats (engine-wide).
SPEC_DRAFTS = Counter(f"{P}spec_decode_drafts", "Request-steps that carried a draft (verifications)")
SPEC_DRAFT_TOKENS = Counter(f"{P}spec_decode_draft_tokens", "Draft tokens proposed and verified")
SPEC_ACCEPTED_TOKENS = Counter(f"{P}spec_decode_accepted_tokens", "Draft tokens the target model accepted")
SPEC_DRAFT_TOKENS_BY_POSITION = Counter(f"{P}spec_decode_draft_tokens_per_position",
                                        "Draft tokens verified, by position in the draft", ["position"])
SPEC_ACCEPTED_BY_POSITION = Counter(f"{P}spec_decode_accepted_tokens_per_position",
                                    "Draft tokens accepted, by position in the draft", ["position"])
SPEC_ACCEPTANCE_LENGTH = Histogram(
    f"{P}spec_decode_acceptance_length",
    "Tokens per verification (accepted drafts + the bonus token), averaged over one engine step's drafts",
    buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0))
SPEC_ACCEPTANCE_RATE = Gauge(f"{P}spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start")

# Speculation, from the proposer (read at each scrape).
SPECULATION_ACTIVE = Gauge(f"{P}speculation_active", "1 if the last engine step carried drafts, else 0")
SPECULATION_THRESHOLD = Gauge(f"{P}speculation_threshold", "Running requests at or below which drafting runs")
SPECULATION_K = Gauge(f"{P}speculation_k", "Draft tokens per step (k)")
DRAFTER_ACTIVE_REQUESTS = Gauge(f"{P}drafter_active_requests", "Requests whose automata the drafter holds")
DRAFTER_HISTORY_TOKENS = Gauge(f"{P}drafter_history_tokens",
                               "Response tokens of earlier rollouts kept as drafting text (cross-epoch history)")
DRAFTER_GLOBAL_TOKENS = Gauge(f"{P}drafter_global_tokens",
                              "Finished responses' tokens held by the global index (DraftPolicy.max_global_tokens)")

# Serving, from vLLM's SchedulerStats and IterationStats.
REQUESTS_RUNNING = Gauge(f"{P}requests_running", "Requests the engine is running")
REQUESTS_WAITING = Gauge(f"{P}requests_waiting", "Requests waiting to be scheduled")
REQUEST_LATENCY = Histogram(f"{P}request_latency_seconds", "End-to-end latency of finished requests",
                            buckets=_LATENCY)
TIME_TO_FIRST_TOKEN = Histogram(f"{P}time_to_first_token_seconds", "Time to the first output token",
                                buckets=_LATENCY)
TIME_PER_OUTPUT_TOKEN = Histogram(f"{P}time_per_output_token_seconds",
                                  "Mean time per output token of each finished request", buckets=_PER_TOKEN)
PROMPT_TOKENS = Histogram(f"{P}request_prompt_tokens", "Prompt length of finished requests", buckets=_TOKENS)
OUTPUT_TOKENS = Histogram(f"{P}request_output_tokens", "Output length of finished requests", buckets=_TOKENS)
REQUESTS_FINISHED = Counter(f"{P}requests_finished", "Finished requests by finish reason", ["finish_reason"])
GENERATED_TOKENS = Counter(f"{P}generated_tokens", "Output tokens generated")
PREEMPTIONS = Counter(f"{P}preemptions", "Running sequences the engine preempted (recomputed later): for KV memory, "
                      "or to continue on new weights (a weight update with in_flight=continue)")
PREFILLED_AGAIN = Counter(f"{P}engine_prefilled_again_tokens",
                          "Tokens the engine prefilled again for preempted sequences it took back, from its own "
                          "prefix-cache lookups at their re-admission (tokens looked up minus cache hits): what a "
                          "weight update with in_flight=continue, or a preemption for KV memory, costs")
HTTP_ERRORS = Counter(f"{P}http_errors", "HTTP responses with an error status, by code", ["code"])

# Rollouts (requests tagged with one rollout id), from the HTTP layer.
ROLLOUT_MAKESPAN = Histogram(f"{P}rollout_makespan_seconds", "First request in to last response out, per rollout",
                             buckets=_LATENCY)
ROLLOUT_TAIL = Histogram(f"{P}rollout_tail_seconds",
                         "Time a rollout spent in its tail (at most `threshold` of its sequences running)",
                         buckets=_LATENCY)
ROLLOUT_TAIL_SHARE = Histogram(f"{P}rollout_tail_share", "Tail time / makespan, per rollout", buckets=_SHARE)
ROLLOUT_LONGEST_TO_MEDIAN = Histogram(f"{P}rollout_longest_to_median_ratio",
                                      "Longest response / median response (tokens), per rollout", buckets=_RATIO)
ROLLOUT_TOKENS = Counter(f"{P}rollout_tokens", "Rollout output tokens from accepted drafts or sampled by the model",
                         ["source"])
ROLLOUTS_ACTIVE = Gauge(f"{P}rollouts_active", "Rollouts with requests in flight")

# Rollout scheduling (`server.admission`).
_ERROR_RATIO = (-0.9, -0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 9.0)
SCHEDULING_POLICY = Gauge(f"{P}rollout_scheduling_info", "The server's rollout scheduling policy (value 1)",
                          ["policy"])
SCHEDULER_WAIT = Histogram(f"{P}scheduler_wait_seconds",
                           "Time a sequence waited in the server for an engine slot (length-aware scheduling)",
                           buckets=_LATENCY)
SCHEDULER_WAITING = Gauge(f"{P}scheduler_waiting_sequences", "Sequences waiting in the server for an engine slot")
SCHEDULER_PREDICTION_ERROR = Histogram(
    f"{P}scheduler_length_prediction_error_ratio",
    "(predicted - actual) / actual output length of non-probe sequences, predicted when admitted", buckets=_ERROR_RATIO)
ENGINE_QUEUE = Histogram(f"{P}engine_queue_seconds", "Time a finished request waited in the engine's queue",
                         buckets=_LATENCY)

WEIGHT_VERSION = Gauge(f"{P}weight_version_info", "The served weight version (value 1)", ["version"])
WEIGHT_PEERS = Gauge(f"{P}weight_peers", "Configured weight peers by the last probe's outcome: answering, unreachable, "
                     "or key_refused (a configuration error: they refuse this server's API key)", ["state"])
WEIGHT_PEERS_ON_OTHER_VERSION = Gauge(f"{P}weight_peers_on_other_version",
                                      "Weight peers that answered serving another weight version than this server")

# Weight updates (`server.runtime.load_weights`, `server.continuation`).
WEIGHT_UPDATE_PAUSE = Histogram(f"{P}weight_update_pause_seconds",
                                "Time generation was held for a weight update (pause to resume; with wait, the "
                                "drain of requests in flight included), by in_flight mode", ["in_flight"],
                                buckets=_LATENCY)
CONTINUED_SEQUENCES = Counter(f"{P}continued_requests",
                              "Sequences with generated tokens that a weight update carried onto the new weights, by "
                              "in_flight mode (continue, continue-keep-kv; each sequence of an n > 1 request counts "
                              "once)", ["in_flight"])
RECOMPUTED_TOKENS = Counter(f"{P}recomputed_tokens",
                            "Prompt + generated tokens of the continued sequences, prefilled again under the new "
                            "weights (at most: siblings' shared prompts may hit the prefix cache)")


def set_weight_version(version: str, previous: str | None = None) -> None:
    """Expose ``version`` as the one served version (the previous label is removed)."""
    if previous is not None and previous != version:
        with contextlib.suppress(KeyError):
            WEIGHT_VERSION.remove(previous)
    WEIGHT_VERSION.labels(version=version).set(1)


def set_scheduling_policy(policy: str) -> None:
    """Expose ``policy`` as the server's one rollout scheduling policy."""
    SCHEDULING_POLICY.clear()
    SCHEDULING_POLICY.labels(policy=policy).set(1)
