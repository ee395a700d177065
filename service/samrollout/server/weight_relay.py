"""Weight files passed on to peer servers while they arrive: a push that costs one checkpoint on the trainer's link.

A trainer pushing to N servers sends each file to the first server of a chain only; that server
stages the file as any upload does and, at the same time, streams the same bytes into the next
server's upload (its ``PUT .../files/<name>``), which does the same for the one after it
(`Relay`).  Every hop checks the SHA-256 of the bytes it received; a hop answers only once the
rest of the chain has answered, so the first server's reply confirms every server's copy
(``relayed``) or names the hop that failed (502).  Committing and cancelling stay with the
client, as for a direct push: all or nothing.

The next hops travel in the ``X-Samrollout-Relay`` header as ``<server_id>/<upload_id>`` pairs.
A server id is an opaque token each server draws at start (`new_server_id`); a server relays
only to the peers of its own configuration (``--weight-peers``), whose ids it learns by asking
them (`WeightPeers.probe`).  A request names no address: an id that is not one of those peers
is a 403, and nothing is sent anywhere (no server-side request forgery).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import secrets
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from samrollout.server.errors import ApiError
from samrollout_client.errors import error_message
from samrollout_client.weights import MAX_RELAY_HOPS, RELAY_HEADER, SERVER_ID_PATTERN, SHA256_HEADER

logger = logging.getLogger("samrollout.server")

PROBE_TIMEOUT_S = 5.0      # a peer that does not say who it is within this is unreachable
RELAY_QUEUE_CHUNKS = 16    # chunks received but not yet passed on: the next hop's pace holds the receiving
_SERVER_ID = re.compile(SERVER_ID_PATTERN)
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


def new_server_id() -> str:
    """A new random id for this server process (16 hex digits): how peers and clients name it in a relay."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Hop:
    """One next hop of a relay: the peer's server id and its upload to stream the file into."""

    server_id: str
    upload_id: str

    def header_value(self) -> str:
        """As the relay header spells it."""
        return f"{self.server_id}/{self.upload_id}"


def parse_relay_header(value: str, own_id: str) -> list[Hop]:
    """The hops of an ``X-Samrollout-Relay`` header; ApiError 400 unless they are ``<server_id>/<upload_id>`` pairs
    (at most `MAX_RELAY_HOPS`, none twice, not this server)."""
    entries = [part.strip() for part in value.split(",") if part.strip()]
    hops = []
    for entry in entries:
        server_id, _, upload_id = entry.partition("/")
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


@dataclass
class Peer:
    """A configured peer as last probed: its URL (an address of it, when its name resolves to several), its id."""

    url: str
    server_id: str | None = None
    error: str | None = None

    def shown(self) -> dict[str, Any]:
        """As ``GET /admin/peers`` lists it."""
        return {"url": self.url, "server_id": self.server_id, "reachable": self.server_id is not None,
                **({"error": self.error} if self.error else {})}


class WeightPeers:
    """The peers this server may relay weight files to (``--weight-peers``), and the relays themselves."""

    def __init__(self, urls: list[str], server_id: str, api_key: str | None, idle_seconds: float) -> None:
        """``idle_seconds``: how long a relay may wait on a peer (the uploads' idle bound)."""
        self.urls, self.server_id = urls, server_id
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: peers are reached directly, never through a proxy the environment names
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(idle_seconds, connect=PROBE_TIMEOUT_S),
                                       trust_env=False)
        self._by_id: dict[str, str] = {}  # server id -> URL, from the last probe
        self._probe_lock = asyncio.Lock()

    async def probe(self) -> list[Peer]:
        """Ask every configured peer (every address of a name that resolves to several) for its id, at once.

        This server itself (a headless service's name resolves to every pod) is left out.
        """
        async with self._probe_lock:
            addresses = await asyncio.gather(*(_addresses(url) for url in self.urls))
            peers = [peer for group in addresses for peer in group]
            await asyncio.gather(*(self._ask_id(peer) for peer in peers if peer.error is None))
            peers = _once_each(peers, self.server_id)
            self._by_id = {peer.server_id: peer.url for peer in peers if peer.server_id is not None}
            return peers

    async def _ask_id(self, peer: Peer) -> None:
        try:
            reply = await self._http.get(f"{peer.url}/admin/identity", timeout=PROBE_TIMEOUT_S)
            reply.raise_for_status()
            server_id = reply.json().get("server_id")
            if not (isinstance(server_id, str) and _SERVER_ID.fullmatch(server_id)):
                raise ValueError("no server_id in its answer: not a samrollout server of this release")
            peer.server_id = server_id
        except (httpx.HTTPError, ValueError) as error:
            peer.error = f"{type(error).__name__}: {error}"[:300]

    async def url_of(self, server_id: str) -> str:
        """The URL of peer ``server_id`` (probing again if it is not known yet); ApiError 403 if it is no peer."""
        if server_id not in self._by_id:
            await self.probe()
        url = self._by_id.get(server_id)
        if url is None:
            raise ApiError(403, f"server {server_id} is not among this server's weight peers (--weight-peers: "
                           f"{len(self.urls)} configured, {len(self._by_id)} answering): a server relays weight "
                           "files only to the peers of its own configuration", RELAY_HEADER)
        return url

    async def relay(self, hops: list[Hop], name: str, sha256: str | None, size: int | None) -> Relay:
        """A relay of file ``name`` to ``hops[0]``, which passes it on to the rest; ApiError 403 for no peer."""
        return Relay(self._http, await self.url_of(hops[0].server_id), hops, name, sha256, size)

    async def aclose(self) -> None:
        """Close the connections to the peers (at shutdown)."""
        await self._http.aclose()


class Relay:
    """One file streamed on to the next hop while it arrives (`tee`); `finish` waits for the chain's confirmations."""

    def __init__(self, http: httpx.AsyncClient, url: str, hops: list[Hop], name: str, sha256: str | None,
                 size: int | None) -> None:
        self.url, self.hops, self.name = url, hops, name
        headers = {SHA256_HEADER: sha256 or "", "Content-Type": "application/octet-stream"}
        if size is not None:
            headers["Content-Length"] = str(size)
        if len(hops) > 1:
            headers[RELAY_HEADER] = ",".join(hop.header_value() for hop in hops[1:])
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(RELAY_QUEUE_CHUNKS)
        target = f"{url}/admin/weight_uploads/{hops[0].upload_id}/files/{name}"
        self._sending = asyncio.create_task(http.put(target, content=self._chunks(), headers=headers))

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
        confirmed = {"server_id": first.server_id, "upload_id": first.upload_id, "bytes": body.get("bytes"),
                     "sha256": body.get("sha256")}
        return [confirmed, *body.get("relayed", [])]

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
        return ApiError(502, f"{where} failed: {reply.status_code}: {error_message(reply, 500)}")


def _once_each(peers: list[Peer], own_id: str) -> list[Peer]:
    """``peers`` without this server and with each server once (a peer reached at several addresses)."""
    seen, kept = {own_id}, []
    for peer in peers:
        if peer.server_id is None or peer.server_id not in seen:
            kept.append(peer)
            if peer.server_id is not None:
                seen.add(peer.server_id)
    return kept


async def _addresses(url: str) -> list[Peer]:
    """``url`` as peers: one per address when its host name resolves to several (a headless service), else itself."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return [Peer(url)]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        return [Peer(url, error=f"cannot resolve {host}: {error}")]
    found = sorted({str(info[4][0]) for info in infos})
    if len(found) <= 1:
        return [Peer(url)]
    return [Peer(urlunsplit((parts.scheme, _netloc(address, port), "", "", ""))) for address in found]


def _netloc(address: str, port: int) -> str:
    """``address:port``, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
