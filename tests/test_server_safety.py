"""Nothing a client or trainer sends can poison, hang or starve the server (issue 33's reproductions).

One real `samrollout serve` on the tiny model with small limits: a 2 s header timeout, 48
connections, 4 engine slots and 4 queued sequences, and the weight value check off, so NaN
weights reach the engine as a diverged trainer's would.  Each test names the answer a user
gets now; the connection tests speak raw HTTP over sockets, as a slow or hostile client does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import API_KEY, TINY_SERVER_MEMORY, server_fixture
from samrollout.testing import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3
MAX_CONNECTIONS = 48
SLOTS, QUEUED = 4, 4
SHUTDOWN_TIMEOUT_S = 10


def guarded_server_args(tiny_dir: Path) -> list[str]:
    """The tiny model behind small connection, queue and header limits, with the weight value check off."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY,
            "--max-model-len", "512", "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY),
            "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
            "--max-connections", str(MAX_CONNECTIONS),
            "--max-num-seqs", str(SLOTS), "--max-queued-requests", str(QUEUED),
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--no-weight-value-check"]


guarded_server = server_fixture("guarded_server", guarded_server_args)


def _greedy(server: ServerProcess, prompt: str = "the same prompt", max_tokens: int = 12) -> list[int]:
    reply = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    ids: list[int] = reply.json()["choices"][0]["token_ids"]
    return ids


def _update(server: ServerProcess, path: Path | str, version: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/update_weights", headers=AUTH, timeout=timeout,
                      json={"path": str(path), "version": version, "in_flight": "wait"})


def _connect(server: ServerProcess) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sends until it closes the connection; raises if it is still open after ``limit_s``."""
    sock.settimeout(limit_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# --- weights ---------------------------------------------------------------------------------------------------


def test_restoring_good_weights_after_nan_weights_served_requests_gives_the_original_tokens(
        guarded_server: ServerProcess, tiny_dir: Path, tmp_path: Path) -> None:
    """The issue's poisoning: NaN weights (past the check, which is off here) serve a request; a restore recovers."""
    original = _greedy(guarded_server)
    (weights,) = tiny_dir.glob("*.safetensors")
    nan = {name: torch.full_like(t, float("nan")) if t.is_floating_point() else t
           for name, t in load_file(str(weights)).items()}
    (tmp_path / "nan").mkdir()
    save_file(nan, str(tmp_path / "nan" / weights.name), metadata={"format": "pt"})
    running = threading.Thread(target=_greedy, args=(guarded_server, "still running", 300))
    running.start()  # in flight while the bad weights arrive: it finishes on the old ones
    time.sleep(0.5)
    assert _update(guarded_server, tmp_path / "nan", "diverged").status_code == 200
    running.join()
    assert set(_greedy(guarded_server, max_tokens=40)) == {0}  # NaN logits: every token is id 0
    assert _update(guarded_server, tiny_dir, "restored").status_code == 200
    assert _greedy(guarded_server) == original
    assert _greedy(guarded_server, "another prompt", 40) == _greedy(guarded_server, "another prompt", 40)


def test_a_fifo_in_the_weights_directory_is_refused_at_once_and_later_updates_still_load(
        guarded_server: ServerProcess, tiny_dir: Path, tmp_path: Path) -> None:
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "model.safetensors")  # nobody ever writes to it
    for attempt in range(6):  # more than the server has worker threads for file work
        reply = _update(guarded_server, fifo_dir, f"fifo-{attempt}", timeout=30)
        assert reply.status_code == 400, reply.text
        assert "model.safetensors is a FIFO" in reply.json()["error"]["message"]
    assert _update(guarded_server, tiny_dir, "after-fifos", timeout=120).status_code == 200
    upload = httpx.post(f"{guarded_server.url}/admin/weight_uploads", headers=AUTH, timeout=30)
    assert upload.status_code == 201, upload.text
    upload_id = upload.json()["upload_id"]
    (weights,) = tiny_dir.glob("*.safetensors")
    piece = weights.read_bytes()[:4096]
    put = httpx.put(f"{guarded_server.url}/admin/weight_uploads/{upload_id}/files/{weights.name}", timeout=30,
                    headers={**AUTH, "X-Content-SHA256": hashlib.sha256(piece).hexdigest()}, content=piece)
    assert put.status_code == 200, put.text
    httpx.delete(f"{guarded_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH, timeout=30)


# --- request bodies ----------------------------------------------------------------------------------------------


def test_a_200_mb_body_is_refused_with_413_before_it_is_read(guarded_server: ServerProcess) -> None:
    sock = _connect(guarded_server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {200 * 1024 * 1024}\r\n\r\n")
    sock.sendall(head.encode() + b'{"model": "tiny", "prompt": [' + b"1, " * 10_000)
    answer = _read_until_closed(sock, limit_s=10)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"--max-request-bytes" in answer
    assert httpx.get(f"{guarded_server.url}/health", timeout=10).status_code == 200


def test_a_chunked_body_growing_past_the_limit_is_refused_with_413(guarded_server: ServerProcess) -> None:
    """No Content-Length: the body is counted as it streams in, and refused once it passes 32 MiB."""
    sock = _connect(guarded_server)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    piece = b"a" * (1024 * 1024)
    try:
        for _ in range(40):  # 40 MiB, over the 32 MiB default
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    except OSError:
        pass  # the server answered and closed while the body was still coming: read what it said
    answer = _read_until_closed(sock, limit_s=30)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"--max-request-bytes" in answer


def test_bodies_under_the_limit_are_served(guarded_server: ServerProcess) -> None:
    reply = httpx.post(f"{guarded_server.url}/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "prompt": list(range(5, 400)), "max_tokens": 2})
    assert reply.status_code == 200, reply.text


# --- connections ----------------------------------------------------------------------------------------------


def test_a_slowloris_connection_is_closed_after_the_header_timeout(guarded_server: ServerProcess) -> None:
    sock = _connect(guarded_server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    started = time.monotonic()
    sock.settimeout(0.5)
    closed = False
    while time.monotonic() - started < HEADER_TIMEOUT_S * 5:
        try:
            sock.sendall(b"X-Slow: 1\r\n")  # a partial header line now and then, never the end of the headers
            if sock.recv(4096) == b"":
                closed = True
                break
        except TimeoutError:
            continue
        except OSError:  # reset by the server
            closed = True
            break
    assert closed, "the server kept a connection open that never finished its headers"


def test_an_idle_new_connection_is_closed_after_the_header_timeout(guarded_server: ServerProcess) -> None:
    sock = _connect(guarded_server)
    assert _read_until_closed(sock, limit_s=HEADER_TIMEOUT_S * 5).startswith(b"HTTP/1.1 408")


def test_a_body_trickled_past_the_body_timeout_gets_408_and_the_connection_closes(
        guarded_server: ServerProcess) -> None:
    # The headers arrive at once (the header timeout is met); the body then comes a byte every half second.
    body = json.dumps({"model": "tiny", "prompt": "trickled", "max_tokens": 2}).encode()
    sock = _connect(guarded_server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    started, answer = time.monotonic(), b""
    sock.settimeout(0.5)
    for byte in body[:-1]:  # never the last byte
        try:
            sock.sendall(bytes([byte]))
            answer += sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:  # closed by the server after its answer
            break
        if answer:
            break
    answer += _read_until_closed(sock, limit_s=BODY_TIMEOUT_S * 5)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--body-timeout" in answer and time.monotonic() - started < BODY_TIMEOUT_S * 5
    assert httpx.get(f"{guarded_server.url}/health", timeout=10).status_code == 200


def test_connections_past_the_limit_get_503_and_are_closed(guarded_server: ServerProcess) -> None:
    idle = [_connect(guarded_server) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        refused = 0
        for sock in idle[MAX_CONNECTIONS:]:
            sock.settimeout(5)
            refused += sock.recv(4096).startswith(b"HTTP/1.1 503")
        assert refused >= 5  # a few may have been counted before earlier idle ones closed
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{guarded_server.url}/health", timeout=10).status_code == 200


# --- the queue ----------------------------------------------------------------------------------------------------


def test_requests_past_the_queue_bound_get_429_with_retry_after(guarded_server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "fill the queue", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=AUTH, timeout=300) as client:
            return list(await asyncio.gather(*(client.post(f"{guarded_server.url}/v1/completions", json=body)
                                               for _ in range(3 * (SLOTS + QUEUED)))))

    replies = asyncio.run(burst())
    codes = [reply.status_code for reply in replies]
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= SLOTS + QUEUED
    busy = next(reply for reply in replies if reply.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1
    assert "--max-queued-requests" in busy.json()["error"]["message"]
    status = httpx.get(f"{guarded_server.url}/admin/status?drafter=false", headers=AUTH, timeout=30).json()
    assert status["queue"]["held_sequences"] == 0  # every hold was given back


def test_the_client_waits_out_429s_and_finishes_every_sample(guarded_server: ServerProcess) -> None:
    from samrollout_client import AsyncRolloutClient, Sampling

    async def rollout() -> list[Any]:
        async with AsyncRolloutClient(guarded_server.url, model="tiny", api_key=API_KEY, max_in_flight=64,
                                      backoff_s=0.2) as client:
            return await client.generate(["a", "b", "c"], n=8, sampling=Sampling(max_tokens=60, temperature=1.0))

    groups = asyncio.run(rollout())
    assert [len(group.samples) for group in groups] == [8, 8, 8]
    assert all(len(sample.token_ids) > 0 for group in groups for sample in group.samples)


# --- auth ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_api_docs_need_the_key(guarded_server: ServerProcess, path: str) -> None:
    assert httpx.get(f"{guarded_server.url}{path}", timeout=30).status_code == 401
    assert httpx.get(f"{guarded_server.url}{path}", headers=AUTH, timeout=30).status_code == 200


@pytest.mark.parametrize("header", [b"Bearer cl\xe9", b"Bearer \xff\xfe", b"\xe9\xe9", b"Basic abc", b"Bearer",
                                    b"bearer  " + API_KEY.encode() + b"x"])
def test_any_malformed_authorization_header_is_401(guarded_server: ServerProcess, header: bytes) -> None:
    sock = _connect(guarded_server)
    sock.sendall(b"GET /admin/status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: " + header +
                 b"\r\n\r\n")
    answer = _read_until_closed(sock, limit_s=30)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"AuthenticationError" in answer


def test_a_file_read_that_blocks_forever_times_out_and_does_not_hold_the_process_at_exit(tmp_path: Path) -> None:
    """`call_with_deadline` on a real blocking read (a FIFO nobody writes): TimeoutError, then a prompt exit."""
    import subprocess
    import sys

    os.mkfifo(tmp_path / "never-written")
    script = ("import asyncio, sys\n"
              "from samrollout.server.engine.bounded_call import call_with_deadline\n"
              "async def main():\n"
              "    try:\n"
              f"        await call_with_deadline(open, {str(tmp_path / 'never-written')!r}, timeout=0.5, name='t')\n"
              "    except TimeoutError:\n"
              "        print('timed out')\n"
              "asyncio.run(main())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "timed out", done.stderr[-2000:]


def test_sigterm_ends_the_server_within_its_grace_period(guarded_server: ServerProcess) -> None:
    """Last in this module: after every test above (FIFO updates included), SIGTERM ends the server cleanly."""
    started = time.monotonic()
    code = guarded_server.stop(timeout=SHUTDOWN_TIMEOUT_S + 60)
    took = time.monotonic() - started
    assert code == 0, guarded_server.log_tail()
    assert took < SHUTDOWN_TIMEOUT_S + 60, took
