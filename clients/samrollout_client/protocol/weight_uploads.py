"""How a pushed weight file travels: the upload URL, the headers, the relay's spelling and its confirmations.

The client (`samrollout_client.weight_sync.weight_push`) sends each file to the first server of a relay chain; that
server (`samrollout.server.weights.weight_relay`) streams it on to the next hop while it arrives, and answers once
the rest of the chain confirmed its copy. Both sides build and read these messages with the functions here, so they
cannot spell them differently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

SHA256_HEADER = "X-Content-SHA256"  # the hex SHA-256 of the file an upload's PUT sends (the server checks it)
RELAY_HEADER = "X-Samrollout-Relay"  # an upload's PUT: the servers to pass the file on to, <server_id>/<upload_id>,...
SERVER_ID_PATTERN = r"[0-9a-f]{16}"  # a server's id (GET /admin/identity), how relays name their hops
MAX_RELAY_HOPS = 64  # servers one relay header may name: a chain is at most this many servers after the first
UPLOADS_PATH = "/admin/weight_uploads"  # POST opens an upload; PUT .../{id}/files/{name} sends one file


def upload_file_url(base_url: str, upload_id: str, file_name: str) -> str:
    """The URL one file of upload ``upload_id`` is PUT to on the server at ``base_url``."""
    return f"{base_url}{UPLOADS_PATH}/{upload_id}/files/{file_name}"


def relay_header(hops: Iterable[tuple[str, str]]) -> str:
    """The relay header's value naming ``hops``, each (server id, upload id), in chain order."""
    return ",".join(f"{server_id}/{upload_id}" for server_id, upload_id in hops)


def relay_entries(value: str) -> list[str]:
    """The hops a relay header names, each as written (``<server_id>/<upload_id>``), unchecked."""
    return [part.strip() for part in value.split(",") if part.strip()]


def relay_hop(entry: str) -> tuple[str, str]:
    """(server id, upload id) of one `relay_entries` entry, unchecked (`relay_header`'s inverse)."""
    server_id, _, upload_id = entry.partition("/")
    return server_id, upload_id


def chain_confirmations(server_id: str | None, upload_id: str, reply: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every copy a file's PUT reply confirms, in chain order: the answering server's (its ``bytes`` and
    ``sha256``, under the ids it was sent as), then the ``relayed`` hops' own confirmations."""
    first = {"server_id": server_id, "upload_id": upload_id, "bytes": reply.get("bytes"),
             "sha256": reply.get("sha256")}
    return [first, *reply.get("relayed", [])]


def error_text(body: str, limit: int = 200) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``), or the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:limit]
