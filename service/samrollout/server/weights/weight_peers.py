"""The servers this one may relay pushed weight files to (``--weight-peers``): who they are, and what they serve.

A server relays only to the peers of its own configuration, whose ids it learns by asking them
(`WeightPeers.probe`: ``GET /admin/identity``, with this server's API key).  Each probe also
says which weight version each peer serves, so a server sees a push that split its peers
(`WeightPeers.summary`, in ``/admin/status``), and a peer that refuses this server's key (401 or
403: the servers were given different keys) is a configuration error, not a peer that is merely
down: ``/admin/peers`` says so, the server logs it (`WeightPeers.watch` probes at start and every
`WATCH_PERIOD_S` after), and ``samrollout_weight_peers{state="key_refused"}`` counts it.

A peer's name that resolves to several addresses (a headless service) stands for each; an
``https`` peer reached at an address keeps its name for TLS: it is sent as the SNI server name,
checked against the certificate, and as the ``Host`` header.  Certificates are checked against
the system's CA certificates (``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` add others).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import secrets
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import httpx

from samrollout.metrics import definitions as m
from samrollout.server.errors import ApiError
from samrollout_client.protocol.weight_uploads import RELAY_HEADER, SERVER_ID_PATTERN

logger = logging.getLogger("samrollout.server")

PROBE_TIMEOUT_S = 5.0  # a peer that does not say who it is within this is unreachable
WATCH_PERIOD_S = 15.0  # how often the peers are asked again (`WeightPeers.watch`)
KEY_REFUSED = ("the peer refused this server's API key ({status}): relays need the same --api-key on every "
               "server (a configuration error; pushes go to it directly meanwhile)")
_SERVER_ID = re.compile(SERVER_ID_PATTERN)
PeerState = Literal["answering", "unreachable", "key_refused"]
Resolver = Callable[[str, int], Awaitable[list[str]]]
"""A peer name and port -> its addresses (OSError when it has none)."""


def new_server_id() -> str:
    """A new random id for this server process (16 hex digits): how peers and clients name it in a relay."""
    return secrets.token_hex(8)


@dataclass
class Peer:
    """A configured peer as last probed: its URL (an address of it, when its name resolves to several), the name
    TLS and ``Host`` use there (``name``, host[:port]; None: the URL's own), its id, version and any problem."""

    url: str
    name: str | None = None
    server_id: str | None = None
    weight_version: str | None = None
    error: str | None = None
    key_refused: bool = False

    @property
    def state(self) -> PeerState:
        """Whether it answered, refused this server's key, or could not be asked."""
        return "answering" if self.server_id else "key_refused" if self.key_refused else "unreachable"

    def request_options(self) -> dict[str, Any]:
        """What each request to this peer carries: its name as ``Host`` and, over TLS, as the SNI server name."""
        if self.name is None:
            return {}
        hostname = urlsplit(f"//{self.name}").hostname or self.name
        options: dict[str, Any] = {"headers": {"Host": self.name}}
        if self.url.startswith("https:"):
            options["extensions"] = {"sni_hostname": hostname}
        return options

    def shown(self) -> dict[str, Any]:
        """As ``GET /admin/peers`` lists it."""
        return {"url": self.url, **({"name": self.name} if self.name else {}), "server_id": self.server_id,
                "reachable": self.server_id is not None, "weight_version": self.weight_version,
                "configuration_error": self.error if self.key_refused else None,
                **({"error": self.error} if self.error else {})}


class WeightPeers:
    """The peers this server may relay weight files to (``--weight-peers``), as last probed."""

    def __init__(self, urls: list[str], server_id: str, api_key: str | None, idle_seconds: float,
                 verify: ssl.SSLContext | None = None, resolve: Resolver | None = None) -> None:
        """``idle_seconds``: how long a relay may wait on a peer (the uploads' idle bound); ``verify``: the TLS
        context for ``https`` peers (default: the system's CA certificates); ``resolve``: a peer name's addresses
        (default: the system's resolver, `system_addresses`)."""
        self.urls, self.server_id = urls, server_id
        self._resolve = resolve or system_addresses
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: peers are reached directly, never through a proxy the environment names
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(idle_seconds, connect=PROBE_TIMEOUT_S),
                                      trust_env=False, verify=verify or ssl.create_default_context())
        self._by_id: dict[str, Peer] = {}  # server id -> peer, from the last probe
        self._last: list[Peer] = []
        self._checked: float | None = None
        self._probe_lock = asyncio.Lock()

    async def probe(self) -> list[Peer]:
        """Ask every configured peer (every address of a name that resolves to several) for its id and version, at
        once.  This server itself (a headless service's name resolves to every pod) is left out."""
        async with self._probe_lock:
            addresses = await asyncio.gather(*(_addresses(url, self._resolve) for url in self.urls))
            peers = [peer for group in addresses for peer in group]
            await asyncio.gather(*(self._ask_id(peer) for peer in peers if peer.error is None))
            peers = _once_each(peers, self.server_id)
            self._by_id = {peer.server_id: peer for peer in peers if peer.server_id is not None}
            self._last, self._checked = peers, time.monotonic()
            return peers

    async def _ask_id(self, peer: Peer) -> None:
        try:
            reply = await self.http.get(f"{peer.url}/admin/identity", timeout=PROBE_TIMEOUT_S,
                                        **peer.request_options())
            if reply.status_code in (401, 403):
                peer.key_refused, peer.error = True, KEY_REFUSED.format(status=reply.status_code)
                return
            reply.raise_for_status()
            body = reply.json()
            server_id = body.get("server_id")
            if not (isinstance(server_id, str) and _SERVER_ID.fullmatch(server_id)):
                raise ValueError("no server_id in its answer: not a samrollout server of this release")
            peer.server_id = server_id
            version = body.get("weight_version")
            peer.weight_version = version if isinstance(version, str) else None
        except (httpx.HTTPError, ValueError) as error:
            peer.error = f"{type(error).__name__}: {error}"[:300]

    async def watch(self, own_version: Callable[[], str], period: float = WATCH_PERIOD_S) -> None:
        """Probe the peers now and every ``period`` seconds (for ever: cancel it), keeping the metrics and logging
        each peer whose key refusal starts or ends; ``own_version()``: the version this server serves."""
        refused: set[str] = set()
        while self.urls:
            try:
                peers = await self.probe()
                now = {peer.url for peer in peers if peer.key_refused}
                for url in sorted(now - refused):
                    logger.error("weight peer %s refused this server's API key: relays need the same --api-key on "
                                 "every server (a configuration error); weight files are pushed to it directly", url)
                for url in sorted(refused - now):
                    logger.info("weight peer %s accepts this server's API key again", url)
                refused = now
                self._count(peers, own_version())
            except Exception:  # a probe's errors are per peer; anything else is logged and the watch goes on
                logger.warning("probing the weight peers failed; trying again in %g s", period, exc_info=True)
            await asyncio.sleep(period)

    @staticmethod
    def _count(peers: list[Peer], own: str) -> None:
        """The peers by state, and those answering with another version than ``own``, as gauges."""
        for state in ("answering", "unreachable", "key_refused"):
            m.WEIGHT_PEERS.labels(state=state).set(sum(peer.state == state for peer in peers))
        m.WEIGHT_PEERS_ON_OTHER_VERSION.set(sum(peer.server_id is not None and peer.weight_version != own
                                                for peer in peers))

    def summary(self, own_version: str) -> dict[str, Any] | None:
        """The last probe's outcome for ``/admin/status``: peers by state, every version served (this server's
        included) and how many serve each, and whether they ``split``; None without peers."""
        if not self.urls:
            return None
        versions: dict[str, int] = {own_version: 1}
        for peer in self._last:
            if peer.server_id is not None and peer.weight_version is not None:
                versions[peer.weight_version] = versions.get(peer.weight_version, 0) + 1
        states = {state: sum(peer.state == state for peer in self._last)
                  for state in ("answering", "unreachable", "key_refused")}
        age = None if self._checked is None else round(time.monotonic() - self._checked, 1)
        return {**states, "versions": versions, "split": len(versions) > 1, "checked_s_ago": age}

    async def peer(self, server_id: str) -> Peer:
        """Peer ``server_id`` (probing again if it is not known yet); ApiError 403 if it is no peer."""
        if server_id not in self._by_id:
            await self.probe()
        found = self._by_id.get(server_id)
        if found is None:
            raise ApiError(403, f"server {server_id} is not among this server's weight peers (--weight-peers: "
                           f"{len(self.urls)} configured, {len(self._by_id)} answering): a server relays weight "
                           "files only to the peers of its own configuration", RELAY_HEADER)
        return found

    async def aclose(self) -> None:
        """Close the connections to the peers (at shutdown)."""
        await self.http.aclose()


def _once_each(peers: list[Peer], own_id: str) -> list[Peer]:
    """``peers`` without this server and with each server once (a peer reached at several addresses)."""
    seen, kept = {own_id}, []
    for peer in peers:
        if peer.server_id is None or peer.server_id not in seen:
            kept.append(peer)
            if peer.server_id is not None:
                seen.add(peer.server_id)
    return kept


async def system_addresses(host: str, port: int) -> list[str]:
    """The addresses the system's resolver gives ``host`` (OSError when it gives none)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def _addresses(url: str, resolve: Resolver) -> list[Peer]:
    """``url`` as peers: one per address when its host name resolves to several (a headless service), each keeping
    the name for ``Host`` and TLS, else itself."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return [Peer(url)]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = sorted(set(await resolve(host, port)))
    except OSError as error:
        return [Peer(url, error=f"cannot resolve {host}: {error}")]
    if len(found) <= 1:
        return [Peer(url)]
    return [Peer(urlunsplit((parts.scheme, _netloc(address, port), "", "", "")), name=parts.netloc)
            for address in found]


def _netloc(address: str, port: int) -> str:
    """``address:port``, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
