"""API-key check for /v1 and /admin: ``Authorization: Bearer <key>`` when a key is configured."""

from __future__ import annotations

import hmac

from fastapi import Request

from samrollout.server.errors import ApiError


async def require_api_key(request: Request) -> None:
    """Reject the request (401) unless it carries the configured key; no key configured: open."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), key.get_secret_value()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
