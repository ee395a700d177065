"""What a weight update and a pause do to the requests in flight, as both sides name them on the wire."""

from __future__ import annotations

from typing import Literal, get_args

InFlight = Literal["wait", "abort", "continue", "continue-keep-kv"]
"""What a weight update does to requests in flight: finish them on the old weights first (``wait``), end them
(``abort``: they return what they have, ``finish_reason: "abort"``), or let them go on under the new weights in
the same response, their tokens then spanning two versions (see `Sample.weight_version_spans`): with their keys
and values computed again under the new weights (``continue``: exact per-version policies, a prefill of every
token in flight) or kept as the old weights computed them (``continue-keep-kv``: no recompute; each token is still
sampled, and its logprob reported, by the forward pass that ran).  What the server does for each is one row of
`samrollout.server.weights.update_modes.UPDATE_MODES`."""
IN_FLIGHT_MODES: tuple[InFlight, ...] = get_args(InFlight)
CONTINUING: tuple[InFlight, ...] = ("continue", "continue-keep-kv")
"""The update modes in which requests in flight go on under the new weights within their response."""

PauseMode = Literal["keep", "wait", "abort"]
"""How ``/admin/pause`` holds generation: freeze running requests at a step boundary (``keep``), let them finish
(``wait``), or end them (``abort``)."""
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
