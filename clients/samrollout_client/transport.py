"""HTTP to the servers: JSON calls whose failures are typed, 429 back-off, calls to every endpoint.

Every part of the client (generation, weight push, version tracking, admin calls) sends through
one `Transport`, so a failure means the same everywhere: a connection error, a timeout or a 5xx
is `Retryable` (worth another endpoint), a 429 is `Busy` (the server is up, its queue full: wait
for its ``Retry-After``), any other 4xx is `RequestRejected` (the request itself is wrong).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import httpx

from samrollout_client.endpoints import Endpoint, EndpointPool
from samrollout_client.errors import RequestRejected, SamrolloutError, error_message

RETRYABLE_ERRORS = (httpx.TransportError, httpx.TimeoutException)  # httpx's failures another endpoint may not have
MAX_BUSY_WAIT_S = 60.0  # the longest one 429 makes a request wait, whatever Retry-After says


class Retryable(SamrolloutError):
    """A failure worth retrying on another endpoint (connection, timeout, 5xx)."""


class Unreachable(Retryable):
    """The connection could not be made: the request never reached the server (it is down or unreachable)."""


class Busy(Retryable):
    """429: the server is up but its queue is full; retry after ``retry_after_s`` (not a failure of the endpoint)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Transport:
    """The client's HTTP connections to its endpoints (``http``, replaceable) and how it reads their answers."""

    def __init__(self, http: httpx.AsyncClient, pool: EndpointPool, *, backoff_s: float,
                 max_busy_retries: int) -> None:
        self.http, self.pool = http, pool
        self.backoff_s, self.max_busy_retries = backoff_s, max_busy_retries

    async def post(self, endpoint: Endpoint, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """POST and decode; 4xx -> `RequestRejected`, 429 -> `Busy`, connection problems and 5xx -> `Retryable`."""
        return await self._call("POST", endpoint, path, body)

    async def get(self, endpoint: Endpoint, path: str) -> dict[str, Any]:
        """GET and decode, failures as for `post`."""
        return await self._call("GET", endpoint, path, None)

    async def _call(self, method: str, endpoint: Endpoint, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            reply = await self.http.request(method, f"{endpoint.url}{path}", json=body)
        except httpx.ConnectError as error:
            raise Unreachable(f"{endpoint.url}: {type(error).__name__}: {error}") from None
        except RETRYABLE_ERRORS as error:
            raise Retryable(f"{endpoint.url}: {type(error).__name__}: {error}") from None
        check_status(endpoint, reply)
        result: dict[str, Any] = reply.json()
        return result

    async def post_when_admitted(self, endpoint: Endpoint, path: str, body: dict[str, Any],
                                 busy: int) -> dict[str, Any]:
        """`post`, waiting out 429s (the server's Retry-After, with backoff) up to ``max_busy_retries`` in all."""
        while True:
            try:
                return await self.post(endpoint, path, body)
            except Busy as error:
                busy += 1
                if busy > self.max_busy_retries:
                    raise SamrolloutError(f"{error} ({self.max_busy_retries} times; max_busy_retries)") from None
                await asyncio.sleep(self.busy_wait_s(error, busy))

    def busy_wait_s(self, error: Busy, busy: int) -> float:
        """How long to wait after the ``busy``-th 429: Retry-After, at least the backoff, capped, with jitter."""
        wait = max(error.retry_after_s, min(MAX_BUSY_WAIT_S, self.backoff_s * 2.0 ** min(busy - 1, 8)))
        jitter: float = random.uniform(1.0, 1.1)
        return min(MAX_BUSY_WAIT_S, wait) * jitter

    async def post_to_all(self, path: str, body: dict[str, Any] | None) -> list[dict[str, Any] | BaseException]:
        """`post` to every endpoint at once: each one's answer or failure, in endpoint order."""
        return list(await asyncio.gather(*(self.post(e, path, body) for e in self.pool.endpoints),
                                         return_exceptions=True))

    async def broadcast(self, path: str, body: dict[str, Any] | None) -> None:
        """`post` to every endpoint; one `SamrolloutError` naming each endpoint that failed."""
        replies = await self.post_to_all(path, body)
        failed = [f"{e.url}: {r}" for e, r in zip(self.pool.endpoints, replies, strict=True)
                  if isinstance(r, BaseException)]
        if failed:
            raise SamrolloutError(f"{path} failed on {len(failed)} endpoint(s): " + "; ".join(failed))


def retry_after_s(reply: httpx.Response) -> float:
    """The reply's ``Retry-After`` in seconds (a number; a date or nothing: 1 s)."""
    try:
        return max(0.0, float(reply.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def check_status(endpoint: Endpoint, reply: httpx.Response) -> None:
    """5xx -> `Retryable`, 429 -> `Busy`, other 4xx -> `RequestRejected` (the body must have been read)."""
    if reply.status_code == 429:
        raise Busy(f"{endpoint.url} is busy (429): {error_message(reply)}", retry_after_s(reply))
    if reply.status_code >= 500:
        raise Retryable(f"{endpoint.url} answered {reply.status_code}: {reply.text[:200]}")
    if reply.status_code >= 400:
        raise RequestRejected(endpoint.url, reply.status_code, error_message(reply))


def raise_failures(what: str, endpoints: Sequence[Endpoint], replies: Sequence[object]) -> None:
    """Raise the failure if one endpoint failed (a `RequestRejected` stays one), or one error naming every endpoint."""
    failed = [(e, r) for e, r in zip(endpoints, replies, strict=True) if isinstance(r, BaseException)]
    if not failed:
        return
    if len(failed) == 1 and isinstance(failed[0][1], SamrolloutError):
        raise failed[0][1]
    details = "; ".join(f"{e.url}: {r}" for e, r in failed)
    raise SamrolloutError(f"{what} failed on {len(failed)} endpoint(s): {details}")
