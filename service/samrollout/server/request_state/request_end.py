"""One end for everything a request holds: its queue hold, its weight-version labels, its rollout's count.

A streamed response's generator may never run (the client hangs up before the response starts), and
one that runs may be closed long after the client left; cleanup in the generator's ``finally``
then happens late or never.  The ASGI call itself always ends, however the request ends, so what a
request holds is given back there: a route registers a callback with `at_request_end`, and the
`RequestEnd` middleware, wrapping every request, runs the request's callbacks in the order they
were registered once its handling is over, streamed or not, disconnected or not.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger("samrollout.server")

_CALLBACKS_KEY = "samrollout.at_request_end"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def at_request_end(scope: Scope, callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the request of ``scope`` ends (after those registered before it)."""
    scope.setdefault(_CALLBACKS_KEY, []).append(callback)


class RequestEnd:
    """ASGI middleware: the callbacks a request registered (`at_request_end`) run when its handling ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        """Run the request, then its callbacks; one that fails is logged and the others still run."""
        try:
            await self.app(scope, receive, send)
        finally:
            for callback in scope.pop(_CALLBACKS_KEY, []):
                try:
                    callback()
                except Exception:  # one broken cleanup must not keep the others from running
                    logger.exception("samrollout: a request's cleanup failed")
