"""The checks every request passes before the app reads a byte of its body: who it is for, who sent it, its key.

An ASGI middleware, so that a refusal costs the server a few header comparisons and never the
body: a client without the key cannot make the server read, buffer or parse 30 MB of JSON, and a
web page in a browser on the server's machine cannot drive it, with a key or without one:

- **Host** (403): the ``Host`` header must be an IP literal, a localhost name, ``--host`` or one of
  ``--allowed-hosts`` (``.example.com`` also admits its subdomains, ``*`` any).  A page that
  rebinds its own DNS name to 127.0.0.1 sends its own name here, so it is refused.
- **Origin** (403): a request carrying an ``Origin`` header (every browser's POST does, ``no-cors``
  included) must come from the server's own origin or one of ``--allowed-origins``.
- **The key** (401, ``Connection: close``): with ``--api-key``, every route but ``/health``,
  ``/metrics`` and, on the trainer's port, AReaL's routes and ``/v1/completions`` (`needs_key`),
  as the routes' own `auth` dependencies say; those stay, this only answers first.
- **JSON bodies** (415): a request with a body to an admin, weight or AReaL route must say
  ``Content-Type: application/json``, which a browser cannot send without a CORS preflight this
  server never grants; the weight files themselves (``PUT /admin/weight_uploads/{id}/files/...``)
  are raw bytes.

Refusals are OpenAI-style JSON errors and close the connection, so the unread body goes with it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from samrollout.server.api.http_limits import ASGIApp, Receive, Scope, Send
from samrollout.server.errors import error_body
from samrollout.server.settings import ServerSettings, is_loopback

_OPEN_PATHS = frozenset({"/health", "/metrics"})
_TRAINER_OPEN = re.compile(r"^/(areal_[a-z_]+|sleep|wake_up|v1/completions)/?$")
_JSON_ONLY = re.compile(r"^/(admin/|areal_[a-z_]+/?$|sleep/?$|wake_up/?$)")
_RAW_UPLOAD = re.compile(r"^/admin/weight_uploads/[^/]+/files/")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), or None."""
    return next((value for key, value in scope.get("headers", ()) if key == name), None)


def split_host(value: str) -> tuple[str, int | None]:
    """A ``Host`` header's name (lower case, brackets and a trailing dot dropped) and port (None if not given)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, ""
    return name.rstrip("."), int(port) if port.isdigit() else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def parse_list(text: str) -> list[str]:
    """A comma-separated setting's entries, trimmed, lower case, empty ones dropped."""
    return [entry.strip().lower() for entry in text.split(",") if entry.strip()]


class HostRule:
    """Which ``Host`` names the server answers to (module docstring)."""

    def __init__(self, listen_host: str, allowed: Iterable[str]) -> None:
        self.listen_host = split_host(listen_host)[0]
        self.allowed = [entry.rstrip(".") for entry in allowed]

    def admits(self, name: str) -> bool:
        """Whether a request naming host ``name`` (from `split_host`) is for this server."""
        if _is_ip(name) or is_loopback(name) or name == self.listen_host:
            return True
        for entry in self.allowed:
            if entry == "*" or entry == name or (entry.startswith(".") and (name.endswith(entry)
                                                                            or name == entry[1:])):
                return True
        return False


class OriginRule:
    """Which browser origins may send requests: the server's own, and those of ``--allowed-origins``."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = {entry.rstrip("/") for entry in allowed}

    def admits(self, origin: str, host: tuple[str, int | None]) -> bool:
        """Whether ``origin`` (the header) may send a request whose ``Host`` is ``host``."""
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.allowed or origin in self.allowed:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            return False  # "null" (a sandboxed page, a file) or anything else
        try:
            port = parts.port or _DEFAULT_PORTS[parts.scheme]
        except ValueError:
            return False
        return parts.hostname.rstrip(".") == host[0] and port == (host[1] or _DEFAULT_PORTS[parts.scheme])


def needs_key(path: str, on_trainer_port: bool) -> bool:
    """Whether a request to ``path`` needs the API key (when one is set): all but the probes, and on the trainer's
    port AReaL's routes and the completions route it calls (`auth`)."""
    if path in _OPEN_PATHS:
        return False
    return not (on_trainer_port and _TRAINER_OPEN.match(path))


def _has_body(scope: Scope) -> bool:
    """Whether the request declares a body: a non-zero Content-Length, or a chunked one."""
    if _header(scope, b"transfer-encoding") is not None:
        return True
    length = _header(scope, b"content-length")
    return length is not None and length.strip() not in (b"", b"0")


def _is_json(scope: Scope) -> bool:
    media = (_header(scope, b"content-type") or b"").split(b";", 1)[0].strip().lower()
    return media == b"application/json"


class RequestGate:
    """ASGI middleware: Host, Origin, key and body type checked from the headers alone (module docstring)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self.hosts = HostRule(settings.host, parse_list(settings.allowed_hosts))
        self.origins = OriginRule(parse_list(settings.allowed_origins))
        self.key = None if settings.api_key is None else settings.api_key.get_secret_value().encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse the request from its headers, or pass it on untouched."""
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await _refuse(send, *refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else None."""
        host = split_host((_header(scope, b"host") or b"").decode("latin-1"))
        if host[0] and not self.hosts.admits(host[0]):
            return 403, (f"host {host[0]!r} is not one this server answers to: add it to --allowed-hosts "
                         "(SAMROLLOUT_ALLOWED_HOSTS) if clients name the server so")
        origin = _header(scope, b"origin")
        if origin is not None and not self.origins.admits(origin.decode("latin-1"), host):
            return 403, (f"requests from origin {origin.decode('latin-1')[:200]!r} are refused: only the server's "
                         "own origin and --allowed-origins (SAMROLLOUT_ALLOWED_ORIGINS) may send them")
        path: str = scope.get("path", "")
        if self.key is not None and needs_key(path, self._on_trainer_port(scope)) and not self._keyed(scope):
            return 401, "missing or wrong API key: send 'Authorization: Bearer <key>'"
        if scope.get("method") in _BODY_METHODS and _JSON_ONLY.match(path) and not _RAW_UPLOAD.match(path) \
                and _has_body(scope) and not _is_json(scope):
            return 415, f"{path} takes a JSON body: send it with 'Content-Type: application/json'"
        return None

    def _on_trainer_port(self, scope: Scope) -> bool:
        server = scope.get("server")
        port = self.settings.areal_port
        return port is not None and isinstance(server, tuple | list) and len(server) == 2 and server[1] == port

    def _keyed(self, scope: Scope) -> bool:
        raw = _header(scope, b"authorization")
        if raw is None or self.key is None:
            return False
        scheme, _, token = raw.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


async def _refuse(send: Send, status: int, message: str) -> None:
    """An OpenAI-style JSON error answered without reading the body; the connection closes after it."""
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
