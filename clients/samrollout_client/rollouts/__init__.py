"""A rollout's machinery beyond one request: partial rollouts for asynchronous RL (`partial`), divided rollouts
that move long samples to less loaded servers (`divided`), the progress bar (`progress`) and the report combined
from every server's summary (`report`).  Their rules (staleness, batch order, moves) are
`samrollout_client.rollout_rules`; where a group goes is `samrollout_client.placement`.
"""
