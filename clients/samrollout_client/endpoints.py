"""Several server endpoints: the choice among those up, down marking and recovery.

A request goes to the up endpoint its caller's rule picks (the client's placement,
`samrollout_client.placement`).
A connection failure or a 5xx marks the endpoint down; a down endpoint is probed
(``GET /health``) after a backoff that doubles on each failed probe (up to
``max_backoff_s``), and comes back when the probe answers 200.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from samrollout_client.errors import NoEndpointAvailable


@dataclass
class Endpoint:
    """One server and what the client knows of it."""

    url: str
    outstanding: int = 0
    down_until: float = 0.0   # monotonic time before which it is not probed again
    down: bool = False
    backoff_s: float = 0.5
    failures: int = 0
    weight_version: str | None = None  # the version it last reported to this client (None: not known yet)
    streaming: int = 0  # of the outstanding requests, those streaming tokens now (divided rollout)


Pick = Callable[[list[Endpoint]], Endpoint]  # which of the endpoints up (never empty) takes a request


class EndpointPool:
    """Chooses, marks down and recovers endpoints."""

    def __init__(self, urls: list[str], min_backoff_s: float = 0.5, max_backoff_s: float = 10.0) -> None:
        if not urls:
            raise ValueError("at least one endpoint URL is needed")
        self.endpoints = [Endpoint(url.rstrip("/"), backoff_s=min_backoff_s) for url in urls]
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s

    def by_url(self, url: str) -> Endpoint:
        """The endpoint with this URL."""
        return next(e for e in self.endpoints if e.url == url)

    async def choose(self, client: httpx.AsyncClient, pick: Pick, avoid: set[str] | None = None,
                     wait_s: float = 30.0) -> Endpoint:
        """The up endpoint ``pick`` chooses (the client's placement; ``avoid`` only if nothing else is up).

        Down endpoints whose backoff has passed are probed first; if all are down, waits
        up to ``wait_s`` for one to recover, then raises `NoEndpointAvailable`.
        """
        deadline = time.monotonic() + wait_s
        while True:
            await self._probe_due(client)
            up = [e for e in self.endpoints if not e.down]
            preferred = [e for e in up if e.url not in (avoid or set())] or up
            if preferred:
                return pick(preferred)
            if time.monotonic() >= deadline:
                raise NoEndpointAvailable(f"all endpoints are down: {[e.url for e in self.endpoints]}")
            await asyncio.sleep(min(e.down_until for e in self.endpoints) - time.monotonic() + 0.01)

    def mark_down(self, endpoint: Endpoint) -> None:
        """Stop sending to ``endpoint`` until a probe finds it healthy."""
        endpoint.failures += 1
        if not endpoint.down:
            endpoint.down, endpoint.backoff_s = True, self.min_backoff_s
        endpoint.down_until = time.monotonic() + endpoint.backoff_s

    def mark_ok(self, endpoint: Endpoint) -> None:
        """``endpoint`` answered: it is up."""
        endpoint.down, endpoint.backoff_s = False, self.min_backoff_s

    async def _probe_due(self, client: httpx.AsyncClient) -> None:
        now = time.monotonic()
        due = [e for e in self.endpoints if e.down and e.down_until <= now]
        for endpoint, healthy in zip(due, await asyncio.gather(*(self._healthy(client, e) for e in due)),
                                     strict=True):
            if healthy:
                self.mark_ok(endpoint)
            else:
                endpoint.backoff_s = min(self.max_backoff_s, endpoint.backoff_s * 2)
                endpoint.down_until = time.monotonic() + endpoint.backoff_s

    @staticmethod
    async def _healthy(client: httpx.AsyncClient, endpoint: Endpoint) -> bool:
        try:
            return (await client.get(f"{endpoint.url}/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False
