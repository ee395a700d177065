"""API-key check for /v1, /admin and the API docs: ``Authorization: Bearer <key>`` when a key is configured.

One exception, for AReaL's trainer, which sends no key: on the trainer's own port (``--areal-port``),
AReaL's routes and ``/v1/completions`` answer without it (`require_api_key_or_trainer_port`);
everything else there needs the key as on ``--port``.  Who may reach that port is the network's
job (the Helm chart's NetworkPolicy admits the trainer's pods only).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from samrollout.server.errors import ApiError

_SCHEME = b"bearer"


def _presented_token(request: Request) -> bytes | None:
    """The bearer token of the request's ``Authorization`` header as raw bytes; None when absent or not bearer.

    Compared as bytes: a header carrying non-ASCII bytes is simply a wrong key (401), never
    a comparison error.
    """
    headers: list[tuple[bytes, bytes]] = request.scope.get("headers", [])
    raw = next((value for name, value in headers if name == b"authorization"), None)
    if raw is None:
        return None
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != _SCHEME:
        return None
    return token.strip()


async def require_api_key(request: Request) -> None:
    """Reject the request (401) unless it carries the configured key; no key configured: open."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    token = _presented_token(request)
    if token is None or not hmac.compare_digest(token, key.get_secret_value().encode("ascii")):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


def on_trainer_port(request: Request) -> bool:
    """Whether ``request`` came in on the trainer's own port (``--areal-port``): the local port it arrived on."""
    port = request.app.state.settings.areal_port
    server = request.scope.get("server")
    return port is not None and isinstance(server, tuple | list) and len(server) == 2 and server[1] == port


async def require_api_key_or_trainer_port(request: Request) -> None:
    """`require_api_key`, except on the trainer's own port, where AReaL's no-key protocol applies (its routes and
    the completions route it calls)."""
    if on_trainer_port(request):
        return
    await require_api_key(request)
