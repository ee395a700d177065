"""Hostile calls for the soak (`soak.py`): what issue 59 found could freeze or exhaust a server, each of which must
be refused (its 4xx, or the connection closed) while the other requests go on.

- a 400 KB ``model_path`` to ``/areal_update_weights`` on the trainer's port (400, at once);
- unauthenticated 30 MB bodies on the main port, several at once (401 before the body is read);
- a foreign ``Host`` and a foreign ``Origin`` (403), a ``text/plain`` admin POST (415);
- a connection flood on the main port: many sockets opened and held a few seconds, then closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any, Protocol

import httpx

BIG_BODY_BYTES = 30 * 1000 * 1000
LONG_PATH = "/" + "a/" * 200_000  # 400 KB


class Recorder(Protocol):
    """Where each call's outcome goes (`soak.Tally`)."""

    def record(self, phase: str, kind: str, seconds: float, outcome: str) -> None:
        """One request: its latency and outcome."""


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def big_unauthenticated_body(url: str) -> bytes:
    """POST a 30 MB JSON body without the key on a raw socket; the answer's first bytes (b"" if closed at once)."""
    host, port = _host_port(url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BIG_BODY_BYTES}\r\n\r\n").encode()
    body = (b'{"prompt": "' + b"x" * (BIG_BODY_BYTES - 16) + b'"}').ljust(BIG_BODY_BYTES, b" ")
    with socket.create_connection((host, port), timeout=60) as sock:
        with contextlib.suppress(OSError):  # refused and closed before the body was read
            sock.sendall(head + body)
        try:
            return sock.recv(4096)
        except OSError:
            return b""


def connection_flood(url: str, count: int, hold_s: float) -> int:
    """Open ``count`` idle connections to ``url``, hold them ``hold_s`` seconds, close them; how many opened."""
    host, port = _host_port(url)
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                opened.append(socket.create_connection((host, port), timeout=10))
            except OSError:
                break
        time.sleep(hold_s)
    finally:
        for sock in opened:
            sock.close()
    return len(opened)


async def _expect(tally: Recorder, kind: str, call: Any, expected: tuple[int, ...]) -> None:
    start = time.perf_counter()
    try:
        reply = await call
        status = reply.status_code
        outcome = "ok" if status in expected else (f"lost: HTTP {status}" if status >= 500 else f"unexpected {status}")
    except httpx.HTTPError as error:
        outcome = f"lost: {type(error).__name__}"
    tally.record("hostile", kind, time.perf_counter() - start, outcome)


async def hostile_round(http: httpx.AsyncClient, url: str, trainer_url: str, tally: Recorder,
                        big_bodies: int = 8, flood: int = 200) -> None:
    """One of each hostile call (big bodies ``big_bodies`` at once, a flood of ``flood`` connections)."""
    admin = f"{url}/admin/update_weights"
    json_type = {"Content-Type": "application/json"}
    await _expect(tally, "long_path_trainer_port", http.post(f"{trainer_url}/areal_update_weights",
                                                             json={"model_path": LONG_PATH}), (400,))
    await _expect(tally, "foreign_host", http.post(admin, content=b"{}", headers={**json_type, "Host": "evil.example"}),
                  (403,))
    await _expect(tally, "foreign_origin", http.post(admin, content=b"{}",
                                                     headers={**json_type, "Origin": "http://evil.example"}), (403,))
    await _expect(tally, "text_plain_post", http.post(admin, content=b'{"path": "/x", "version": "x"}',
                                                      headers={"Content-Type": "text/plain"}), (415,))
    start = time.perf_counter()
    answers = await asyncio.gather(*(asyncio.to_thread(big_unauthenticated_body, url) for _ in range(big_bodies)))
    for answer in answers:
        ok = answer == b"" or answer.startswith(b"HTTP/1.1 401")
        tally.record("hostile", "big_unauthenticated_body", time.perf_counter() - start,
                     "ok" if ok else f"unexpected {answer[:40]!r}")
    start = time.perf_counter()
    flooding = asyncio.create_task(asyncio.to_thread(connection_flood, url, flood, 3.0))
    await asyncio.sleep(1.0)
    await _expect(tally, "trainer_port_during_flood", http.get(f"{trainer_url}/health"), (200,))
    opened = await flooding
    tally.record("hostile", "connection_flood", time.perf_counter() - start, "ok" if opened else "unexpected 0 opened")
