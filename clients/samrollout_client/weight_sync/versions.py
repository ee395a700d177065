"""Which weight versions a client's servers serve, in the order it saw them, and who hears of a newer one.

The order is what a sample's staleness is counted in (`Sample.staleness`), so it is the order
versions were *served*: a version an endpoint reports (``/health``, a response's spans) is
newest when first met, and a version this client's own update loaded is newest from then on,
also when its name was used before.  Open partial rollouts listen, to bound their staleness.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

import httpx

from samrollout_client.endpoints import Endpoint
from samrollout_client.errors import SamrolloutError
from samrollout_client.transport import Transport


class VersionTracker:
    """The versions seen served, oldest first (``versions``), read from the endpoints through ``transport``."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.versions: list[str] = []
        self._listeners: list[Callable[[], None]] = []

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a newer version is served."""
        self._listeners.append(listener)

    def stop_listening(self, listener: Callable[[], None]) -> None:
        """Forget ``listener`` (no error if it is not listening)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def of(self, endpoint: Endpoint) -> str | None:
        """The version ``endpoint``'s /health reports (remembered on the endpoint and seen), or None."""
        try:
            reply = await self._transport.http.get(f"{endpoint.url}/health", timeout=10.0)
            version: str | None = reply.json().get("weight_version") if reply.status_code == 200 else None
        except httpx.HTTPError:
            return None
        endpoint.weight_version = version or endpoint.weight_version
        if version:
            self.saw([version])
        return version

    async def refresh(self) -> None:
        """Ask every endpoint which version it serves."""
        await asyncio.gather(*(self.of(e) for e in self._transport.pool.endpoints))

    async def wait_for(self, version: str, timeout_s: float, endpoints: Sequence[Endpoint] | None = None) -> None:
        """Return once every endpoint's (or each of ``endpoints``') /health reports ``version``; SamrolloutError after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        asked = list(self._transport.pool.endpoints if endpoints is None else endpoints)
        while True:
            versions = await asyncio.gather(*(self.of(e) for e in asked))
            if all(v == version for v in versions):
                return
            if time.monotonic() > deadline:
                raise SamrolloutError(f"not every endpoint serves {version!r} after {timeout_s} s: {versions}")
            await asyncio.sleep(0.5)

    def saw(self, versions: Iterable[str], notify: bool = True) -> None:
        """Record versions not met before as the newest, in the order given (listeners told if ``notify``)."""
        new = [v for v in dict.fromkeys(versions) if v not in self.versions]
        if not new:
            return
        self.versions += new
        if notify:
            self._notify()

    def served(self, version: str) -> None:
        """Every endpoint serves ``version`` now, after this client's update: it is the newest."""
        if self.versions and self.versions[-1] == version:
            return
        if version in self.versions:  # a name used again: its place is now
            self.versions.remove(version)
        self.versions.append(version)
        self._notify()

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()
