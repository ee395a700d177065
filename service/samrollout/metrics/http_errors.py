"""ASGI middleware counting error responses by status code (``samrollout_http_errors_total``).

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so streaming and disconnect
detection (vLLM's `with_cancellation` reads the receive channel) pass through untouched.
"""

from __future__ import annotations

from typing import Any

from samrollout.metrics import definitions as m


class CountHttpErrors:
    """Wraps the app; counts every response whose status is 400 or above."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request through, watching the response's status."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and int(message["status"]) >= 400:
                m.HTTP_ERRORS.labels(code=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
