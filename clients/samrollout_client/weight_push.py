"""New weights sent to every server over HTTP and loaded all or nothing (`AsyncRolloutClient.push_weights`).

Each file goes to every endpoint at once with its SHA-256 (``POST/PUT /admin/weight_uploads``);
only once every endpoint holds every file are the uploads committed, each loading them as
``/admin/update_weights`` loads a directory.  A failure before the commits cancels every upload,
so nothing is loaded anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from samrollout_client.endpoints import Endpoint
from samrollout_client.errors import RequestRejected, SamrolloutError, error_message
from samrollout_client.transport import Transport, raise_failures
from samrollout_client.types import InFlight, WeightPush
from samrollout_client.versions import VersionTracker
from samrollout_client.weights import SHA256_HEADER, WeightFile, WeightFiles


async def push_weights(transport: Transport, versions: VersionTracker, source: WeightFiles, version: str,
                       in_flight: InFlight, timeout_s: float) -> WeightPush:
    """Upload ``source`` to every endpoint, commit it as ``version`` everywhere, wait until all serve it."""
    started = time.monotonic()
    endpoints = list(transport.pool.endpoints)
    opened = await transport.post_to_all("/admin/weight_uploads", None)
    uploads = [(e, str(r["upload_id"])) for e, r in zip(endpoints, opened, strict=True) if isinstance(r, dict)]
    names: list[str] = []
    sent = 0
    try:
        raise_failures("opening a weight upload", endpoints, opened)
        for endpoint, reply in zip(endpoints, opened, strict=True):
            assert isinstance(reply, dict)
            if source.total_bytes is not None and source.total_bytes > int(reply["max_bytes"]):
                raise RequestRejected(endpoint.url, 413, f"these weights ({source.total_bytes} bytes) exceed the "
                                      f"server's upload bound of {reply['max_bytes']} bytes "
                                      "(--max-weight-upload-bytes)")
        async for file in source.files():
            replies = await asyncio.gather(*(_put_file(transport, e, upload, file) for e, upload in uploads),
                                           return_exceptions=True)
            raise_failures(f"sending {file.name}", endpoints, replies)
            names.append(file.name)
            sent += file.size * len(uploads)
    except BaseException:
        await asyncio.gather(*(_cancel_upload(transport, e, upload) for e, upload in uploads),
                             return_exceptions=True)
        raise
    uploaded = time.monotonic()
    body = {"version": version, "in_flight": in_flight}
    commits = await asyncio.gather(*(transport.post(e, f"/admin/weight_uploads/{upload}/commit", body)
                                     for e, upload in uploads), return_exceptions=True)
    raise_failures("committing the weights", endpoints, commits)
    await versions.wait_for(version, timeout_s)
    versions.served(version)
    done = time.monotonic()
    return WeightPush(version=version, endpoints=len(uploads), files=names, bytes=sent // max(len(uploads), 1),
                      bytes_sent=sent, upload_s=uploaded - started, load_s=done - uploaded, seconds=done - started)


async def _put_file(transport: Transport, endpoint: Endpoint, upload_id: str, file: WeightFile) -> None:
    """Stream one file into an upload; 4xx -> `RequestRejected`, anything else -> `SamrolloutError`."""
    url = f"{endpoint.url}/admin/weight_uploads/{upload_id}/files/{file.name}"
    headers = {SHA256_HEADER: file.sha256, "Content-Length": str(file.size), "Content-Type": "application/octet-stream"}
    try:
        reply = await transport.http.put(url, content=file.chunks(), headers=headers)
    except httpx.HTTPError as error:
        raise SamrolloutError(f"{endpoint.url}: sending {file.name} failed: {type(error).__name__}: {error}") \
            from None
    if reply.status_code >= 400:
        raise RequestRejected(endpoint.url, reply.status_code, error_message(reply))


async def _cancel_upload(transport: Transport, endpoint: Endpoint, upload_id: str) -> None:
    """Cancel an upload (best effort: one that expired or was committed is gone anyway)."""
    with contextlib.suppress(httpx.HTTPError):
        await transport.http.delete(f"{endpoint.url}/admin/weight_uploads/{upload_id}", timeout=30.0)
