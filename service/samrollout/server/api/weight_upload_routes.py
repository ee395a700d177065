"""Admin routes of weights pushed over HTTP (no shared disk), API key required when one is configured.

- ``POST /admin/weight_uploads`` opens an upload (answers its id and this server's ``server_id``);
  ``GET /admin/weight_uploads`` lists the open ones;
- ``PUT .../{id}/files/{name}`` streams one ``*.safetensors`` file (``X-Content-SHA256`` header) and,
  with an ``X-Samrollout-Relay`` header, passes it on to the peers it names while it arrives
  (`weight_relay`);
- ``POST .../{id}/commit`` {version, in_flight} checks and loads the files as update_weights does;
  ``GET .../{id}`` shows an upload, ``DELETE .../{id}`` cancels it (`weight_uploads`);
  ``GET .../{id}/commit``: the commit's outcome, pending, loaded or failed (`commit_outcomes`);
- ``GET /admin/identity``: this server's id; ``GET /admin/peers``: the peers it may relay to, asked now.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from pydantic import Field
from starlette.requests import ClientDisconnect

from samrollout.server.api.admin_bodies import ADMIN_ERRORS, IN_FLIGHT_HELP, AdminBody
from samrollout.server.api.auth import require_api_key
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.errors import ApiError
from samrollout.server.weights.weight_relay import parse_relay_header, start_relay
from samrollout.server.weights.weight_uploads import Upload, check_file_name
from samrollout_client.protocol.modes import InFlight
from samrollout_client.protocol.weight_uploads import RELAY_HEADER, SHA256_HEADER

router = APIRouter(prefix="/admin", dependencies=[Depends(require_api_key)])

_UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    **ADMIN_ERRORS, 403: {"description": "a relay names a server that is not one of this server's --weight-peers"},
    404: {"description": "no such open upload"}, 413: {"description": "over --max-weight-upload-bytes"},
    429: {"description": "--max-weight-uploads are open"}, 502: {"description": "a peer of the relay failed"},
    507: {"description": "the staging disk is full"}}
_FILE_BODY: dict[str, Any] = {"requestBody": {"required": True, "description": "the file's bytes, streamed",
                                              "content": {"application/octet-stream": {
                                                  "schema": {"type": "string", "format": "binary"}}}}}


class CommitUpload(AdminBody):
    """The version tag of the uploaded weights, and what happens to requests in flight while they load."""

    version: str = Field(min_length=1, max_length=128, description="weight version reported with responses")
    in_flight: InFlight = Field("wait", description=IN_FLIGHT_HELP)


def _runtime(request: Request) -> ServerRuntime:
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


@router.get("/identity", responses=ADMIN_ERRORS)
async def identity(request: Request) -> dict[str, Any]:
    """This server's id (drawn at start; how relays name it) and the weight version it serves."""
    runtime = _runtime(request)
    return {"server_id": runtime.weight_peers.server_id, "weight_version": runtime.served_version}


@router.get("/peers", responses=ADMIN_ERRORS)
async def peers(request: Request) -> dict[str, Any]:
    """The peers this server may relay weight files to (``--weight-peers``), each asked now for its id and version.

    A peer that does not answer within a few seconds is listed with ``reachable: false`` and the
    error; one that refuses this server's API key also has a ``configuration_error`` (the servers
    were given different keys).  A client pushing weights sends directly to the servers no peer
    can reach.  ``weight_version``: what this server serves; ``versions_agree``: whether every
    peer that answered serves it too (false after a push that split the servers).
    """
    runtime = _runtime(request)
    found = await runtime.weight_peers.probe()
    return {"server_id": runtime.weight_peers.server_id, "weight_version": runtime.served_version,
            "versions_agree": all(peer.weight_version == runtime.served_version for peer in found if peer.server_id),
            "peers": [peer.shown() for peer in found]}


@router.post("/weight_uploads", responses=_UPLOAD_ERRORS, status_code=201)
async def open_weight_upload(request: Request) -> dict[str, Any]:
    """Open an upload of new weights (no shared disk needed): PUT its files, then commit it.

    Answers its ``upload_id``, its byte bound (``max_bytes``), ``expires_in_s`` (an upload
    left idle that long is deleted) and this server's ``server_id`` (for relays).
    """
    runtime = _runtime(request)
    return {**runtime.weight_uploads.describe(runtime.weight_uploads.create()),
            "server_id": runtime.weight_peers.server_id}


@router.get("/weight_uploads", responses=ADMIN_ERRORS)
async def list_weight_uploads(request: Request) -> dict[str, Any]:
    """The open uploads, as ``GET .../{id}`` shows each."""
    uploads = _runtime(request).weight_uploads
    return {"uploads": [uploads.describe(upload) for upload in uploads.open_uploads()]}


@router.put("/weight_uploads/{upload_id}/files/{file_name:path}", responses=_UPLOAD_ERRORS,
            openapi_extra=_FILE_BODY)
async def put_weight_file(upload_id: str, file_name: str, request: Request,
                          sha256: Annotated[str | None, Header(alias=SHA256_HEADER, description=(
                              "hex SHA-256 of the file; a mismatch is a 400 and the file is dropped"))] = None,
                          relay: Annotated[str | None, Header(alias=RELAY_HEADER, description=(
                              "pass the file on while it arrives: <server_id>/<upload_id> of each next server, "
                              "comma-separated, each one of this server's --weight-peers (else 403)"))] = None,
                          ) -> dict[str, Any]:
    """Stream one ``*.safetensors`` file into the upload (to disk as it arrives; its SHA-256 checked at the end).

    A plain file name only (no directories); sending a name again replaces that file.  With a
    relay, the answer comes once every next server has the file intact, listed in ``relayed``
    (server id, upload id, bytes, the SHA-256 each computed); a failure on the way is a 502
    naming the server.
    """
    runtime = _runtime(request)
    length = request.headers.get("content-length")
    declared = int(length) if length and length.isdigit() else None
    chunks: AsyncIterator[bytes] = request.stream()
    passing_on = None
    if relay is not None:
        runtime.weight_uploads.get(upload_id)  # 404 before anything reaches a peer
        check_file_name(file_name)  # 400 naming it: a name this server refuses never reaches a peer either
        passing_on = await start_relay(runtime.weight_peers, parse_relay_header(relay, runtime.weight_peers.server_id),
                                       file_name, sha256, declared)
        chunks = passing_on.tee(chunks)
    try:
        result = await runtime.weight_uploads.receive(upload_id, file_name, chunks, sha256, declared)
    except BaseException as error:
        if passing_on is not None:
            passing_on.abort()
        if isinstance(error, ClientDisconnect):
            raise ApiError(400, f"the client disconnected before {file_name} was complete; it is not staged") \
                from None
        raise
    if passing_on is not None:
        result["relayed"] = await passing_on.finish()
    return result


@router.get("/weight_uploads/{upload_id}", responses=_UPLOAD_ERRORS)
async def get_weight_upload(upload_id: str, request: Request) -> dict[str, Any]:
    """An open upload: its complete files and their sizes, bytes staged, seconds until it expires if left idle."""
    uploads = _runtime(request).weight_uploads
    return uploads.describe(uploads.get(upload_id))


@router.post("/weight_uploads/{upload_id}/commit", responses=_UPLOAD_ERRORS)
async def commit_weight_upload(upload_id: str, body: CommitUpload, request: Request) -> dict[str, Any]:
    """Check the uploaded files and load them as ``version``, exactly as /admin/update_weights loads a directory.

    The upload ends either way: loaded (200) or refused (400 naming the file and tensor;
    the old weights keep serving); its files are deleted.  The commit runs to its end even when
    its caller goes away; ``GET .../{id}/commit`` tells its outcome (`commit_outcomes`).
    """
    runtime = _runtime(request)
    upload = runtime.weight_uploads.begin_commit(upload_id)
    runtime.commit_outcomes.started(upload_id, body.version)
    loading = asyncio.create_task(_commit(runtime, upload, body), name=f"samrollout-commit-{upload_id}")
    _COMMITS.add(loading)
    loading.add_done_callback(_commit_ended)
    result = await asyncio.shield(loading)  # a caller gone away cancels its wait, not the commit
    return {**result, "upload_id": upload_id, "files": sorted(upload.files),
            "bytes": sum(size for size, _ in upload.files.values())}


_COMMITS: set[asyncio.Task[dict[str, Any]]] = set()  # commits running (a task is kept until it ends)


def _commit_ended(task: asyncio.Task[dict[str, Any]]) -> None:
    """Forget an ended commit; its error was recorded in its outcome (and answered, when its caller still waited)."""
    _COMMITS.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a commit whose caller went away logs no "exception never retrieved"


async def _commit(runtime: ServerRuntime, upload: Upload, body: CommitUpload) -> dict[str, Any]:
    """The commit's check and load, its upload closed after; its outcome recorded here too, so that it is known
    when the request that started it was cancelled (its caller went away)."""
    outcome = runtime.commit_outcomes.get(upload.upload_id)
    try:
        result = await runtime.load_weights(str(upload.folder), body.version, body.in_flight, param=None,
                                            source=f"weight upload {upload.upload_id}")
    except BaseException as error:
        runtime.commit_outcomes.failed(outcome, error)
        raise
    finally:
        runtime.weight_uploads.finish(upload)
    runtime.commit_outcomes.loaded(outcome)
    return result


@router.get("/weight_uploads/{upload_id}/commit", responses=_UPLOAD_ERRORS)
async def weight_upload_commit(upload_id: str, request: Request) -> dict[str, Any]:
    """The outcome of the upload's commit: ``state`` pending (checking or loading), loaded, or failed (``error``,
    ``status``: what the commit answered).  A client whose commit request timed out asks this until it is known."""
    return _runtime(request).commit_outcomes.get(upload_id).shown()


@router.delete("/weight_uploads/{upload_id}", responses=_UPLOAD_ERRORS)
async def cancel_weight_upload(upload_id: str, request: Request) -> dict[str, Any]:
    """Cancel an open upload: its files are deleted and nothing is loaded."""
    upload = _runtime(request).weight_uploads.cancel(upload_id)
    return {"upload_id": upload.upload_id, "cancelled": True}
