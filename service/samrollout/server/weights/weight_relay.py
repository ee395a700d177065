"""Weight files passed on to peer servers while they arrive: a push that costs one checkpoint on the trainer's link.

A trainer pushing to N servers sends each file to the first server of a chain only; that server
stages the file as any upload does and, at the same time, streams the same bytes into the next
server's upload (its ``PUT .../files/<name>``), which does the same for the one after it
(`Relay`).  Every hop checks the SHA-256 of the bytes it received; a hop answers only once the
rest of the chain has answered, so the first server's reply confirms every server's copy
(``relayed``) or names the hop that failed (502).  Committing and cancelling stay with the
client, as for a direct push: all or nothing.

The next hops travel in the ``X-Samrollout-Relay`` header as ``<server_id>/<upload_id>`` pairs.
A server id is an opaque token each server draws at start (`weight_peers.new_server_id`); a server
relays only to the peers of its own configuration (``--weight-peers``), whose ids it learns by
asking them (`weight_peers.WeightPeers.probe`).  A request names no address: an id that is not one
of those peers is a 403, and nothing is sent anywhere (no server-side request forgery).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from samrollout.server.errors import ApiError
from samrollout.server.weights.weight_peers import Peer, WeightPeers
from samrollout_client.protocol.weight_uploads import (
    MAX_RELAY_HOPS,
    RELAY_HEADER,
    SERVER_ID_PATTERN,
    SHA256_HEADER,
    chain_confirmations,
    error_text,
    relay_entries,
    relay_header,
    relay_hop,
    upload_file_url,
)

RELAY_QUEUE_CHUNKS = 16    # chunks received but not yet passed on: the next hop's pace holds the receiving
_SERVER_ID = re.compile(SERVER_ID_PATTERN)
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Hop:
    """One next hop of a relay: the peer's server id and its upload to stream the file into."""

    server_id: str
    upload_id: str


def parse_relay_header(value: str, own_id: str) -> list[Hop]:
    """The hops of an ``X-Samrollout-Relay`` header; ApiError 400 unless they are ``<server_id>/<upload_id>`` pairs
    (at most `MAX_RELAY_HOPS`, none twice, not this server)."""
    hops = []
    for entry in relay_entries(value):
        server_id, upload_id = relay_hop(entry)
        if not (_SERVER_ID.fullmatch(server_id) and _UPLOAD_ID.fullmatch(upload_id)):
            raise ApiError(400, f"{RELAY_HEADER}: {entry[:80]!r} is not <server_id>/<upload_id> (a peer's 16-hex "
                           "server id, a 32-hex upload id); peers are named by id, never by address", RELAY_HEADER)
        hops.append(Hop(server_id, upload_id))
    if not hops or len(hops) > MAX_RELAY_HOPS:
        raise ApiError(400, f"{RELAY_HEADER}: name 1 to {MAX_RELAY_HOPS} hops (got {len(hops)})", RELAY_HEADER)
    ids = [hop.server_id for hop in hops]
    if own_id in ids or len(set(ids)) != len(ids):
        raise ApiError(400, f"{RELAY_HEADER}: a relay visits each server once, and not the one it starts from",
                       RELAY_HEADER)
    return hops


async def start_relay(peers: WeightPeers, hops: list[Hop], name: str, sha256: str | None,
                      size: int | None) -> Relay:
    """A relay of file ``name`` to ``hops[0]``, which passes it on to the rest; ApiError 403 if that is no peer."""
    return Relay(peers.http, await peers.peer(hops[0].server_id), hops, name, sha256, size)


class Relay:
    """One file streamed on to the next hop while it arrives (`tee`); `finish` waits for the chain's confirmations."""

    def __init__(self, http: httpx.AsyncClient, peer: Peer, hops: list[Hop], name: str, sha256: str | None,
                 size: int | None) -> None:
        self.url, self.hops, self.name = peer.url, hops, name
        options = peer.request_options()  # an https peer reached at an address: its name for Host and TLS
        headers = {**options.pop("headers", {}), SHA256_HEADER: sha256 or "",
                   "Content-Type": "application/octet-stream"}
        if size is not None:
            headers["Content-Length"] = str(size)
        if len(hops) > 1:
            headers[RELAY_HEADER] = relay_header((hop.server_id, hop.upload_id) for hop in hops[1:])
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(RELAY_QUEUE_CHUNKS)
        target = upload_file_url(peer.url, hops[0].upload_id, name)
        self._sending = asyncio.create_task(http.put(target, content=self._chunks(), headers=headers, **options))

    async def _chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    async def tee(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``chunks``, each also queued for the next hop (waiting while it lags); ApiError 502 once it failed."""
        async for chunk in chunks:
            await self._put(chunk)
            yield chunk
        await self._put(None)

    async def _put(self, chunk: bytes | None) -> None:
        if self._sending.done():
            raise self._failure()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(chunk)
            return
        putting = asyncio.ensure_future(self._queue.put(chunk))
        await asyncio.wait({putting, self._sending}, return_when=asyncio.FIRST_COMPLETED)
        if not putting.done():
            putting.cancel()
            raise self._failure()

    async def finish(self) -> list[dict[str, Any]]:
        """Once the file is received here: the next hops' confirmations, in chain order; ApiError 502 if one failed.

        Each says ``server_id``, ``upload_id``, ``bytes`` and the ``sha256`` that hop computed.
        """
        with contextlib.suppress(Exception):
            await self._sending
        if not self._succeeded():
            raise self._failure()
        first = self.hops[0]
        body = self._sending.result().json()
        return chain_confirmations(first.server_id, first.upload_id, body)

    def abort(self) -> None:
        """Stop passing the file on (this hop failed): the next hop sees its sender go and stages nothing."""
        self._sending.cancel()

    def _succeeded(self) -> bool:
        """Whether the next hop answered (the sending is done) with a success."""
        return (not self._sending.cancelled() and self._sending.exception() is None
                and self._sending.result().status_code < 400)

    def _failure(self) -> ApiError:
        """ApiError 502: what the next hop answered, or why it could not be reached."""
        hop = self.hops[0]
        where = f"relaying {self.name} to peer {hop.server_id} ({self.url})"
        if not self._sending.done():
            return ApiError(502, f"{where} failed: the peer stopped reading")
        if self._sending.cancelled():
            return ApiError(502, f"{where} was cancelled")
        error = self._sending.exception()
        if error is not None:
            return ApiError(502, f"{where} failed: {type(error).__name__}: {error}")
        reply = self._sending.result()
        return ApiError(502, f"{where} failed: {reply.status_code}: {error_text(reply.text, 500)}")
