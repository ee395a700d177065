"""Connection-level limits uvicorn does not enforce by itself: header time, open connections, body size.

- `guarded_http_protocol` wraps uvicorn's HTTP protocol class: a connection must deliver a
  request's complete headers within ``header_timeout`` seconds of opening (or of its previous
  response), so slowloris clients and idle sockets are closed; beyond ``max_connections`` open
  connections a new one gets a 503 and is closed at once.  Each listening port has its own budget
  (`ConnectionBudgets`): the trainer's port (``--areal-port``) counts only its own connections,
  so a client holding every connection of ``--port`` cannot lock the trainer out.  Idle keep-alive connections are
  closed by uvicorn's own ``timeout_keep_alive``.
- `BodyLimit` is an ASGI middleware refusing request bodies over ``max_bytes`` with a 413: from
  ``Content-Length`` before any of the body is read, or while a chunked body streams in, so a
  huge body never sits in memory; and a body still arriving ``body_timeout`` seconds after the
  app started reading it with a 408, so a client trickling a body byte by byte cannot hold a
  request (and its connection) open after its headers came in time.  Weight files pushed to
  ``/admin/weight_uploads`` stream to disk under their own limits (``--max-weight-upload-bytes``,
  an idle upload's expiry) and are exempt from both.

Connections refused or timed out here are counted in ``samrollout_http_errors_total`` (503, 408)
like the app's own error responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

from samrollout.metrics.definitions import HTTP_ERRORS
from samrollout.server.errors import error_body

logger = logging.getLogger("samrollout.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Weight files stream to disk with their own size limit (weight_uploads.py).
_EXEMPT_PATHS = re.compile(r"^/admin/weight_uploads/[^/]+/files/")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, written without the app."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


class ConnectionBudgets:
    """How many connections each listening port may hold open, and how many it holds now."""

    def __init__(self, default_limit: int, limits: dict[int, tuple[int, str]] | None = None) -> None:
        """``default_limit``: any port's (``--max-connections``); ``limits``: port -> (its own limit, its flag)."""
        self.default_limit, self.limits = default_limit, dict(limits or {})
        self.open: dict[int | None, int] = {}

    def limit(self, port: int | None) -> tuple[int, str]:
        """The limit of connections on ``port`` and the flag that sets it."""
        return self.limits.get(port, (self.default_limit, "--max-connections")) if port is not None \
            else (self.default_limit, "--max-connections")

    def take(self, port: int | None) -> bool:
        """Count a new connection on ``port``; False (not counted) when the port's budget is spent."""
        if self.open.get(port, 0) >= self.limit(port)[0]:
            return False
        self.open[port] = self.open.get(port, 0) + 1
        return True

    def release(self, port: int | None) -> None:
        """A counted connection on ``port`` closed."""
        self.open[port] = max(0, self.open.get(port, 0) - 1)


def _local_port(transport: asyncio.BaseTransport) -> int | None:
    """The local port a connection arrived on (None for a socket without one)."""
    name = transport.get_extra_info("sockname")
    return name[1] if isinstance(name, tuple) and len(name) >= 2 else None


def _refuse_over_budget(transport: Any, limit: int, setting: str, port: int | None) -> None:
    """Answer a connection past its port's budget with a 503 and close it (counted like the app's errors)."""
    logger.warning("refused a connection on port %s: %d open (%s)", port, limit, setting)
    message = f"too many open connections (at most {limit}, {setting})"
    transport.write(_raw_response(503, "Service Unavailable", message))
    transport.close()
    HTTP_ERRORS.labels(code="503").inc()


def connection_budgets(max_connections: int, trainer_port: int | None = None,
                       trainer_max_connections: int = 256) -> ConnectionBudgets:
    """``--max-connections`` for every port, and ``trainer_port`` (``--areal-port``) with a budget of its own."""
    own = {} if trainer_port is None else {trainer_port: (trainer_max_connections, "--trainer-max-connections")}
    return ConnectionBudgets(max_connections, own)


def guarded_http_protocol(base: type[asyncio.Protocol], budgets: ConnectionBudgets,
                          header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` with a header deadline and a connection limit per port (`budgets`,
    module docstring)."""
    timed_out = _raw_response(408, "Request Timeout",
                              f"request headers not received within {header_timeout:g} s (--header-timeout)")

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        """uvicorn's protocol, closing connections that are over the limit or too slow to send headers."""

        _header_timer: asyncio.TimerHandle | None = None
        _awaited_cycle: Any = None
        _counted: tuple[int | None] | None = None  # (the port) while this connection is counted in its budget

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            port = _local_port(transport)
            if not budgets.take(port):
                _refuse_over_budget(self.transport, *budgets.limit(port), port)
                return
            self._counted = (port,)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._awaited_cycle:
                self._cancel_header_timer()  # a new request's headers are complete

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is finished:
                self._arm_header_timer()  # no pipelined request started: the next one's headers are timed

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._counted is not None:
                budgets.release(self._counted[0])
                self._counted = None
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._awaited_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._awaited_cycle and not self.transport.is_closing():
                self.transport.write(timed_out)
                self.transport.close()
                HTTP_ERRORS.labels(code="408").inc()

    GuardedHTTPProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol


class BodyTooLarge(HTTPException):
    """A request body over the limit, found while it streams in (answered 413 by the error handlers)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body over {max_bytes} bytes (--max-request-bytes)",
                         headers={"Connection": "close"})


class BodyTooSlow(HTTPException):
    """A request body still arriving after the body timeout (answered 408 by the error handlers)."""

    def __init__(self, body_timeout: float) -> None:
        super().__init__(408, f"request body not received within {body_timeout:g} s (--body-timeout)",
                         headers={"Connection": "close"})


class BodyLimit:
    """ASGI middleware: 413 for request bodies over ``max_bytes``, 408 for one slower than ``body_timeout``."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float) -> None:
        self.app, self.max_bytes, self.body_timeout = app, max_bytes, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 413 for a declared body over the limit; otherwise run the app, counting the body's bytes."""
        if scope["type"] != "http" or _EXEMPT_PATHS.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_too_large(send, declared, self.max_bytes)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        """``receive`` that raises `BodyTooLarge` once the body read so far passes the limit, and `BodyTooSlow`
        when the body is not complete ``body_timeout`` seconds after the first read (what is received after the
        body, such as a disconnect a streamed response waits for, is not timed)."""
        seen, complete, deadline = 0, False, None

        async def counted() -> Message:
            nonlocal seen, complete, deadline
            if complete:
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline if deadline is not None else loop.time() + self.body_timeout
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:  # answered (and counted) as a 408 by the error handlers
                raise BodyTooSlow(self.body_timeout) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            else:
                complete = True  # a disconnect: nothing more will come
            return message

        return counted


def _content_length(scope: Scope) -> int | None:
    """The request's declared ``Content-Length``, or None (absent or malformed: the server's parser decides)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_too_large(send: Send, declared: int, max_bytes: int) -> None:
    """A 413 answered before any of the body is read; the connection closes after it."""
    body = json.dumps(error_body(413, f"request body of {declared} bytes is over the {max_bytes}-byte limit "
                                      "(--max-request-bytes)")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
