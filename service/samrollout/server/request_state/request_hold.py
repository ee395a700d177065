"""A hold on new generation requests, as the routes see it: AReaL's pause provides one (`areal.generation_gate`).

The engine's runtime keeps whatever hold the app installed (none without ``--areal-routes``); the OpenAI
routes wait at it and ``/admin/status`` shows it, without knowing whose it is.
"""

from __future__ import annotations

from typing import Any, Protocol


class RequestHold(Protocol):
    """Something new generation requests wait at before they reach the engine."""

    async def wait(self) -> None:
        """Return once new requests may go on (at once when nothing holds them)."""

    def status(self) -> dict[str, Any]:
        """What ``/admin/status`` shows of the hold."""
