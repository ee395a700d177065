"""The gate AReaL's pause closes: new generation requests wait at it until generation is continued.

AReaL pauses generation around each weight update (``/areal_pause_generation``, then
``/areal_update_weights``, then ``/areal_continue_generation``, `areal_routes`).  Its own vLLM
server holds the completion requests that arrive meanwhile (neither 503 nor 429: AReaL would
retry and then drop the episode) and lets them through on continue, so that they run on the
new weights.  A weight load resumes the engine when it is done (`ServerRuntime.load_weights`);
the gate is what keeps new requests out until the trainer says go.  The requests in flight
when the gate closed are not its business: the pause aborted them or froze them.

What it holds is bounded: at most ``max_held`` requests wait at once (``--areal-max-held-requests``;
one more gets a 429 with Retry-After), each at most ``hold_timeout`` seconds (``--areal-hold-timeout``;
then a 503), so a pause that is never continued cannot pile up connections and memory forever.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from samrollout.server.errors import ApiError

AReaLPause = Literal["abort", "continue"]
"""What AReaL's pause does to the requests in flight: abort them with their tokens so far (AReaL's own server,
and what its stock engine expects: it sends them again itself), or freeze them and let them go on under the next
weights within the same response (`samrollout_client.areal`'s engine, which reads the per-token versions)."""


class GenerationGate:
    """Open, or closed by AReaL's pause; `wait` returns at once while open, else when it opens."""

    def __init__(self, max_held: int = 4096, hold_timeout: float = 1200.0) -> None:
        """``max_held``: requests that may wait at once; ``hold_timeout``: seconds each may wait (module docstring)."""
        self._open = asyncio.Event()
        self._open.set()
        self.pause: AReaLPause = "abort"  # what the last pause did to requests in flight
        self.waiting = 0                  # requests waiting for it to open
        self.max_held, self.hold_timeout = max_held, hold_timeout

    @property
    def closed(self) -> bool:
        """True between a pause and the continue after it."""
        return not self._open.is_set()

    def close(self, pause: AReaLPause) -> None:
        """Hold new requests; ``pause`` says what the pause did to those in flight (read by the weight update)."""
        self.pause = pause
        self._open.clear()

    def open(self) -> None:
        """Let waiting and new requests through."""
        self._open.set()

    async def wait(self) -> None:
        """Return once the gate is open (at once when it is); ApiError 429 when `max_held` already wait, 503 when it
        stays closed `hold_timeout` seconds."""
        if self._open.is_set():
            return
        if self.waiting >= self.max_held:
            raise ApiError(429, f"generation is paused by the trainer and {self.max_held} requests already wait for "
                           "it to continue (--areal-max-held-requests); retry later", headers={"Retry-After": "5"})
        self.waiting += 1
        try:
            await asyncio.wait_for(self._open.wait(), self.hold_timeout)
        except TimeoutError:
            raise ApiError(503, f"generation stayed paused by the trainer for {self.hold_timeout:g} s "
                           "(--areal-hold-timeout): the request was not run; send it again") from None
        finally:
            self.waiting -= 1

    def status(self) -> dict[str, Any]:
        """For /admin/status: closed or not, what the pause did to requests in flight, how many wait."""
        return {"paused": self.closed, "in_flight": self.pause, "waiting_requests": self.waiting,
                "max_held_requests": self.max_held}
