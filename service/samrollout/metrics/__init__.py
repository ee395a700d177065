"""Prometheus metrics (prefix ``samrollout_``): speculation, serving, rollouts, weight version.

`definitions` holds every metric with its unit; `engine_stats` feeds them from vLLM's own
per-step statistics (a stat logger given to the engine), `drafter` from the proposer's
counters, `rollouts` from the HTTP layer's view of requests tagged with a rollout id, and
`aborts` the requests aborted from the API side, which the engine's statistics never see.
"""
