"""What each weight-update mode does to the requests in flight: one row per `InFlight` value.

The update code (`ServerRuntime.load_weights`) and AReaL's routes read these rows instead of testing mode names,
so adding a mode is its `InFlight` value, its row here, and the code that handles a new kind of row.
"""

from __future__ import annotations

from dataclasses import dataclass

from samrollout_client.protocol.modes import IN_FLIGHT_MODES, InFlight, PauseMode


@dataclass(frozen=True)
class UpdateMode:
    """How an update pauses generation and what becomes of the requests in flight and the caches."""

    pause: PauseMode       # how generation is held while the weights load (vLLM's pause mode)
    continues: bool        # requests in flight go on under the new weights, within their responses
    keeps_kv: bool         # the KV and prefix caches survive the update (else zeroed and dropped)
    preempts: bool         # running requests are preempted before the load: their KV is computed again after


UPDATE_MODES: dict[InFlight, UpdateMode] = {
    "wait": UpdateMode(pause="wait", continues=False, keeps_kv=False, preempts=False),
    "abort": UpdateMode(pause="abort", continues=False, keeps_kv=False, preempts=False),
    # vLLM's "keep" pause freezes the running requests; they are then preempted and recomputed.
    "continue": UpdateMode(pause="keep", continues=True, keeps_kv=False, preempts=True),
    # frozen with their KV blocks, which they keep (the new weight epoch keeps later requests off them).
    "continue-keep-kv": UpdateMode(pause="keep", continues=True, keeps_kv=True, preempts=False),
}
"""Every `InFlight` mode's row (checked at import: no mode without one)."""

if set(UPDATE_MODES) != set(IN_FLIGHT_MODES):  # pragma: no cover - a mode added without its row
    raise RuntimeError(f"update modes without a row: {sorted(set(IN_FLIGHT_MODES) - set(UPDATE_MODES))}")


def update_mode(in_flight: InFlight) -> UpdateMode:
    """The row of ``in_flight``."""
    return UPDATE_MODES[in_flight]
