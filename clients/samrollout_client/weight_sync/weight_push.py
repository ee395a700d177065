"""New weights sent to every server over HTTP and staged there, not loaded yet (`stage_weights`).

Each file goes out with its SHA-256 (``POST/PUT /admin/weight_uploads``).  With ``fan_out`` (the
default) the client asks each server which of the others it may relay to (``GET /admin/peers``:
the servers' own ``--weight-peers``) and sends each file once per *chain* of servers
(`relay_chains`): the first stages it and passes it on to the next while it arrives, and so on,
so the trainer's link carries about one checkpoint whatever the number of servers.  Servers no
peer can reach (or all of them, without peers or with ``fan_out=False``) get the file directly.
The first server's answer lists what every server of its chain received and its SHA-256; the
client checks each against the file.  A failure anywhere cancels every upload, so nothing is
staged or loaded anywhere, and the error says which version each server still serves.  Loading
the staged files is `weight_commit`'s (`AsyncRolloutClient.push_weights` does both).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from samrollout_client.endpoints import Endpoint
from samrollout_client.errors import RequestRejected, SamrolloutError, error_message
from samrollout_client.protocol.weight_uploads import (
    MAX_RELAY_HOPS,
    RELAY_HEADER,
    SHA256_HEADER,
    UPLOADS_PATH,
    chain_confirmations,
    relay_header,
    upload_file_url,
)
from samrollout_client.transport import Transport, raise_failures
from samrollout_client.weight_sync.weight_files import WeightFile, WeightFiles

logger = logging.getLogger("samrollout_client")


@dataclass(frozen=True)
class UploadTarget:
    """One server's open upload: where to send, its upload id, and the server's id (how relays name it)."""

    endpoint: Endpoint
    upload_id: str
    server_id: str | None


@dataclass
class StagedWeights:
    """Weights every endpoint of ``targets`` holds staged, checked and not loaded: what `weight_commit` loads."""

    targets: list[UploadTarget]
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    bytes_sent: int = 0
    relay_chains: list[list[str]] = field(default_factory=list)
    upload_s: float = 0.0

    @property
    def endpoints(self) -> list[str]:
        """The URLs of the endpoints holding the upload."""
        return [target.endpoint.url for target in self.targets]


async def stage_weights(transport: Transport, source: WeightFiles, fan_out: bool = True,
                        endpoints: Sequence[Endpoint] | None = None) -> StagedWeights:
    """Upload ``source`` to every endpoint (or each of ``endpoints``), relayed along chains with ``fan_out``; on any
    failure every upload is cancelled and the error names what each endpoint serves (`naming_versions`)."""
    started = time.monotonic()
    endpoints = list(transport.pool.endpoints if endpoints is None else endpoints)
    opened = await asyncio.gather(*(transport.post(e, UPLOADS_PATH, None) for e in endpoints),
                                  return_exceptions=True)
    targets = [UploadTarget(e, str(r["upload_id"]), r.get("server_id")) for e, r in zip(endpoints, opened, strict=True)
               if isinstance(r, dict)]
    staged = StagedWeights(targets)
    chains = [[target] for target in targets]
    try:
        raise_failures("opening a weight upload", endpoints, opened)
        _check_bound(source, endpoints, opened)
        if fan_out and len(targets) > 1:
            reachable = await _reachable_peers(transport, targets)
            chains = [[targets[i] for i in chain] for chain in relay_chains([t.server_id for t in targets], reachable)]
        heads = [chain[0].endpoint for chain in chains]
        async for file in source.files():
            replies = await asyncio.gather(*(_send_along(transport, chain, file) for chain in chains),
                                           return_exceptions=True)
            raise_failures(f"sending {file.name}", heads, replies)
            staged.files.append(file.name)
            staged.bytes += file.size
            staged.bytes_sent += file.size * len(chains)
    except BaseException as error:
        await cancel_uploads(transport, targets)
        if isinstance(error, SamrolloutError):
            raise await naming_versions(transport, endpoints, error, "nothing was staged or loaded") from error
        raise
    staged.relay_chains = [[t.endpoint.url for t in chain] for chain in chains]
    staged.upload_s = time.monotonic() - started
    return staged


async def cancel_uploads(transport: Transport, targets: Sequence[UploadTarget]) -> None:
    """Cancel every upload of ``targets`` (best effort: one that expired, was committed or whose server is gone is
    gone anyway)."""
    await asyncio.gather(*(_cancel_upload(transport, t) for t in targets), return_exceptions=True)


async def served_versions(transport: Transport, endpoints: Sequence[Endpoint]) -> list[str | None]:
    """The version each endpoint's ``/health`` reports now (None: it does not answer)."""
    async def of(endpoint: Endpoint) -> str | None:
        try:
            reply = await transport.http.get(f"{endpoint.url}/health", timeout=10.0)
            version = reply.json().get("weight_version") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return version if isinstance(version, str) else None

    return list(await asyncio.gather(*(of(endpoint) for endpoint in endpoints)))


def versions_text(urls: Sequence[str], versions: Sequence[str | None]) -> str:
    """``url serves 'v'; url does not answer; ...``: which endpoint serves which version."""
    return "; ".join(f"{url} serves {version!r}" if version is not None else f"{url} does not answer"
                     for url, version in zip(urls, versions, strict=True))


async def naming_versions(transport: Transport, endpoints: Sequence[Endpoint], error: SamrolloutError,
                          outcome: str) -> SamrolloutError:
    """``error`` (a `RequestRejected` stays one, with its status) with ``outcome`` and each endpoint's version now."""
    said = f"{outcome}: {versions_text([e.url for e in endpoints], await served_versions(transport, endpoints))}"
    if isinstance(error, RequestRejected):
        return RequestRejected(error.endpoint, error.status, f"{error.message}; {said}")
    return SamrolloutError(f"{error}; {said}")


def relay_chains(server_ids: Sequence[str | None], reachable: Sequence[set[str]]) -> list[list[int]]:
    """The servers (by index) grouped into chains: each server after the first of a chain is one its predecessor
    can reach (``reachable[i]``: the ids server ``i`` relays to), each server in exactly one chain, at most
    ``MAX_RELAY_HOPS`` after the first; greedy, in the given order.  No one reachable: one chain per server."""
    left = list(range(len(server_ids)))
    chains = []
    while left:
        chain = [left.pop(0)]
        while len(chain) <= MAX_RELAY_HOPS:
            following = next((j for j in left if server_ids[j] is not None and server_ids[j] in reachable[chain[-1]]),
                             None)
            if following is None:
                break
            left.remove(following)
            chain.append(following)
        chains.append(chain)
    return chains


def _check_bound(source: WeightFiles, endpoints: list[Endpoint], opened: list[dict[str, Any] | BaseException]) -> None:
    """`RequestRejected` 413 when the weights are known to exceed a server's upload bound."""
    for endpoint, reply in zip(endpoints, opened, strict=True):
        assert isinstance(reply, dict)
        if source.total_bytes is not None and source.total_bytes > int(reply["max_bytes"]):
            raise RequestRejected(endpoint.url, 413, f"these weights ({source.total_bytes} bytes) exceed the "
                                  f"server's upload bound of {reply['max_bytes']} bytes (--max-weight-upload-bytes)")


async def _reachable_peers(transport: Transport, targets: list[UploadTarget]) -> list[set[str]]:
    """Each server's peers that answer now (``GET /admin/peers``); none for a server that cannot say."""
    async def peers_of(target: UploadTarget) -> set[str]:
        try:
            reply = await transport.get(target.endpoint, "/admin/peers")
        except SamrolloutError:  # a server of an older release, or one that failed to ask: push to it directly
            return set()
        for peer in reply.get("peers", []):
            if peer.get("configuration_error"):
                logger.warning("%s cannot relay weight files to %s: %s", target.endpoint.url, peer.get("url"),
                               peer["configuration_error"])
        return {str(p["server_id"]) for p in reply.get("peers", []) if p.get("reachable") and p.get("server_id")}

    return list(await asyncio.gather(*(peers_of(target) for target in targets)))


async def _send_along(transport: Transport, chain: list[UploadTarget], file: WeightFile) -> None:
    """Stream one file to the chain's first server, which relays it along the rest; check every server's copy.

    4xx -> `RequestRejected`, anything else (a relay that failed: 502) -> `SamrolloutError`.
    """
    head = chain[0]
    url = upload_file_url(head.endpoint.url, head.upload_id, file.name)
    headers = {SHA256_HEADER: file.sha256, "Content-Length": str(file.size), "Content-Type": "application/octet-stream"}
    if len(chain) > 1:
        headers[RELAY_HEADER] = relay_header((str(t.server_id), t.upload_id) for t in chain[1:])
    try:
        reply = await transport.http.put(url, content=file.chunks(), headers=headers)
    except httpx.HTTPError as error:
        raise SamrolloutError(f"{head.endpoint.url}: sending {file.name} failed: {type(error).__name__}: {error}") \
            from None
    if 400 <= reply.status_code < 500:
        raise RequestRejected(head.endpoint.url, reply.status_code, error_message(reply))
    if reply.status_code >= 400:
        raise SamrolloutError(f"{head.endpoint.url}: sending {file.name} failed ({reply.status_code}): "
                              f"{error_message(reply)}")
    _check_copies(chain, file, reply.json())


def _check_copies(chain: list[UploadTarget], file: WeightFile, reply: dict[str, Any]) -> None:
    """`SamrolloutError` unless every server of the chain reports the file's size and SHA-256, in chain order."""
    copies = chain_confirmations(chain[0].server_id, chain[0].upload_id, reply)
    expected = [(t.server_id, t.upload_id, file.size, file.sha256) for t in chain]
    found = [(c.get("server_id"), c.get("upload_id"), c.get("bytes"), c.get("sha256")) for c in copies]
    if found != expected:
        raise SamrolloutError(f"{chain[0].endpoint.url}: {file.name} was not confirmed by every server of its relay "
                              f"chain (expected {expected}, got {found})")


async def _cancel_upload(transport: Transport, target: UploadTarget) -> None:
    """Cancel an upload (best effort: one that expired or was committed is gone anyway)."""
    with contextlib.suppress(httpx.HTTPError):
        await transport.http.delete(f"{target.endpoint.url}{UPLOADS_PATH}/{target.upload_id}", timeout=30.0)
