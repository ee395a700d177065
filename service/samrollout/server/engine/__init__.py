"""The running engine: start-up (`startup`), the runtime that holds the engine and runs the RL operations on it
(`runtime`: weight updates, pause, sleep, abort by rollout), length-aware admission (`admission`,
`scheduled_engine`, `length_predictor`), requests that continue across an update (`continuation`), the drafter's
stats (`drafter_stats_cache`), the engine's death (`engine_watch`), vLLM's arguments (`vllm_argv`).

May import `weights`, `request_state`, `errors`, `settings` and `vllm_compat`; never a route.
"""

MAY_IMPORT = ("vllm_compat", "errors", "settings", "request_state", "weights")
