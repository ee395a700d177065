"""API-key check for /v1, /admin and the API docs: ``Authorization: Bearer <key>`` when a key is configured."""

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
