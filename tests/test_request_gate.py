"""Nothing a caller sends freezes the server, and no browser can drive it (issue 59, items 1, 2, 3 and 6).

Two real servers on the tiny model.  `gate_server` has an API key, AReaL's routes on the
trainer's own port, a weights root, a main port of only `MAIN_CONNECTIONS` connections, and a
pause that holds at most `MAX_HELD` requests for `HOLD_TIMEOUT_S` seconds.  conftest's
`held_server` has no key (loopback, AReaL's routes): the Host, Origin and body-type checks hold there too.

- a 400 KB ``model_path`` on the trainer's port: a 400 naming the limit in under a second,
  ``/health`` answering in under a second throughout (before issue 59 it froze the server 130 s);
- 50 concurrent unauthenticated 30 MB bodies: refused before they are read, the server's memory
  within 200 MB of where it was, and it serves afterwards;
- with every connection of the main port held, the trainer's port still answers;
- requests held by a pause are capped (429) and time out (503), each with a clear error;
- a ``text/plain`` POST (415), a foreign ``Host`` (403) and a foreign ``Origin`` (403) are refused
  in no-key mode, while the real client (a weight push included) and the openai client work.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from conftest import TINY_CONTEXT, TINY_SERVER_MEMORY, server_fixture
from samrollout.testing import ServerProcess, free_port
from samrollout_client import RolloutClient, Sampling

KEY = "request-gate-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TRAINER_PORT = free_port()
TRAINER = f"http://127.0.0.1:{TRAINER_PORT}"
ROOT = Path(tempfile.gettempdir()) / f"samrollout-test-gate-root-{os.getpid()}"
MAIN_CONNECTIONS = 16
MAX_HELD, HOLD_TIMEOUT_S = 2, 8
PROBE = {"model": "tiny", "prompt": "the gate", "max_tokens": 4, "temperature": 0}
BIG_BODY_BYTES = 30 * 1000 * 1000
RSS_MARGIN_KB = 200 * 1024


def gate_server_args(tiny_dir: Path) -> list[str]:
    """A key, AReaL's routes on the trainer's port, a weights root, few main-port connections, a small hold."""
    ROOT.mkdir(exist_ok=True)
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", KEY, "--areal-routes",
            "--areal-port", str(TRAINER_PORT), "--weights-root", str(ROOT), "--max-connections", str(MAIN_CONNECTIONS),
            "--header-timeout", "60", "--areal-max-held-requests", str(MAX_HELD),
            "--areal-hold-timeout", str(HOLD_TIMEOUT_S), "--max-model-len", str(TINY_CONTEXT), "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


gate_server = server_fixture("gate_server", gate_server_args)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _health_latencies(url: str, stop: threading.Event, worst: list[float]) -> None:
    """Ask ``url``/health until ``stop``; the slowest answer's seconds in ``worst`` (a failure counts as 60)."""
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                ok = client.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            worst.append(time.monotonic() - start if ok else 60.0)
            time.sleep(0.05)


def test_a_400_kb_path_on_the_trainer_port_is_a_400_at_once_and_health_keeps_answering(
        gate_server: ServerProcess) -> None:
    path = "/" + "a/" * 200_000  # 400 KB: resolving it on the event loop took minutes
    stop, worst = threading.Event(), [0.0]
    watcher = threading.Thread(target=_health_latencies, args=(gate_server.url, stop, worst))
    watcher.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        reply = httpx.post(f"{TRAINER}/areal_update_weights", json={"model_path": path}, timeout=300)
        took = time.monotonic() - start
        time.sleep(0.5)
    finally:
        stop.set()
        watcher.join()
    assert took < 1.0 and max(worst) < 1.0, (took, max(worst))
    assert reply.status_code == 400, reply.text[:300]
    assert "4096 bytes" in reply.json()["error"]["message"] and reply.json()["error"]["param"] == "model_path"
    name = httpx.post(f"{gate_server.url}/admin/update_weights", headers=AUTH, timeout=30,
                      json={"path": f"{ROOT}/{'n' * 300}", "version": "x"})
    assert name.status_code == 400 and "255 bytes" in name.json()["error"]["message"], name.text


def _send_big_body(url: httpx.URL) -> bytes:
    """POST a 30 MB JSON body without the key over a raw socket; what the server answered (or b"" if it hung up)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BIG_BODY_BYTES}\r\n\r\n").encode()
    body = b'{"model": "tiny", "prompt": "' + b"x" * (BIG_BODY_BYTES - 32) + b'"}'
    body = body.ljust(BIG_BODY_BYTES, b" ")
    with socket.create_connection((url.host, url.port), timeout=120) as sock:
        with contextlib.suppress(OSError):  # refused and closed before the body was read: what should happen
            sock.sendall(head + body)
        try:
            return sock.recv(4096)
        except OSError:
            return b""


def test_unauthenticated_big_bodies_leave_memory_bounded_and_the_server_serving(gate_server: ServerProcess) -> None:
    before = _rss_kb(gate_server.process.pid)
    url = httpx.URL(gate_server.url)
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(_rss_kb(gate_server.process.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(max_workers=50) as pool:
            answers = list(pool.map(lambda _: _send_big_body(url), range(50)))
    finally:
        stop.set()
        sampler.join()
    assert all(a == b"" or a.startswith(b"HTTP/1.1 401") for a in answers), [a[:100] for a in answers]
    assert any(a.startswith(b"HTTP/1.1 401") for a in answers)
    assert max(peak) - before < RSS_MARGIN_KB, (before, max(peak))
    reply = httpx.post(f"{gate_server.url}/v1/completions", headers=AUTH, json=PROBE, timeout=120)
    assert reply.status_code == 200, reply.text


def test_the_trainer_port_answers_while_every_main_port_connection_is_held(gate_server: ServerProcess) -> None:
    url = httpx.URL(gate_server.url)
    held = [socket.create_connection((url.host, url.port), timeout=30) for _ in range(MAIN_CONNECTIONS + 4)]
    try:
        time.sleep(0.5)
        try:
            main: int | None = httpx.get(f"{gate_server.url}/health", timeout=10).status_code
        except httpx.HTTPError:
            main = None  # closed at once
        assert main in (503, None), main  # the main port's budget is spent
        trainer = httpx.post(f"{TRAINER}/v1/completions", json=PROBE, timeout=120)
        assert trainer.status_code == 200, trainer.text
        assert httpx.get(f"{TRAINER}/health", timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_requests_held_by_a_pause_are_capped_and_time_out_with_a_clear_error(gate_server: ServerProcess) -> None:
    assert httpx.post(f"{TRAINER}/areal_pause_generation", json={}, timeout=60).status_code == 200
    try:
        with ThreadPoolExecutor(max_workers=MAX_HELD) as pool:
            held = [pool.submit(httpx.post, f"{TRAINER}/v1/completions", json=PROBE, timeout=120)
                    for _ in range(MAX_HELD)]
            deadline = time.monotonic() + 30
            while httpx.get(f"{gate_server.url}/admin/status", headers=AUTH, timeout=30).json()["areal"][
                    "waiting_requests"] < MAX_HELD:
                assert time.monotonic() < deadline, "the held requests never arrived"
                time.sleep(0.1)
            over = httpx.post(f"{TRAINER}/v1/completions", json=PROBE, timeout=120)
            timed_out = [future.result() for future in held]
    finally:
        assert httpx.post(f"{TRAINER}/areal_continue_generation", timeout=60).status_code == 200
    assert over.status_code == 429 and "--areal-max-held-requests" in over.json()["error"]["message"], over.text
    assert over.headers.get("retry-after")
    for reply in timed_out:
        assert reply.status_code == 503 and "--areal-hold-timeout" in reply.json()["error"]["message"], reply.text
    assert httpx.post(f"{TRAINER}/v1/completions", json=PROBE, timeout=120).status_code == 200


def test_a_request_without_the_key_is_refused_before_its_body_with_connection_close(
        gate_server: ServerProcess) -> None:
    reply = httpx.post(f"{gate_server.url}/admin/update_weights", json={"path": str(ROOT), "version": "x"}, timeout=30)
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "AuthenticationError"
    assert reply.headers["connection"] == "close"
    assert httpx.get(f"{gate_server.url}/health", timeout=30).status_code == 200  # the probes need no key


@pytest.mark.parametrize(("what", "headers", "status"), [
    ("a text/plain body", {"Content-Type": "text/plain"}, 415),
    ("a form body", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("a foreign Host", {"Host": "evil.example", "Content-Type": "application/json"}, 403),
    ("a foreign Origin", {"Origin": "http://evil.example", "Content-Type": "application/json"}, 403),
    ("a null Origin", {"Origin": "null", "Content-Type": "application/json"}, 403)])
def test_browser_shaped_requests_are_refused_without_a_key(held_server: ServerProcess, what: str,
                                                           headers: dict[str, str], status: int) -> None:
    for path in ("/admin/update_weights", "/areal_update_weights"):
        reply = httpx.post(f"{held_server.url}{path}", timeout=30, headers=headers,
                           content=f'{{"path": "{ROOT}", "model_path": "{ROOT}", "version": "x"}}')
        assert reply.status_code == status, (what, path, reply.text)
        assert reply.json()["error"]["code"] == status
    own = httpx.get(f"{held_server.url}/admin/status", timeout=30,
                    headers={"Origin": held_server.url})
    assert own.status_code == 200, own.text  # the server's own origin is served


@pytest.fixture
def client(held_server: ServerProcess) -> Iterator[RolloutClient]:
    with RolloutClient(held_server.url, model="tiny", max_in_flight=8) as rollout_client:
        yield rollout_client


def test_the_real_client_and_the_openai_client_still_work(held_server: ServerProcess, client: RolloutClient,
                                                          tiny_dir: Path) -> None:
    groups = client.generate(["hello", "world"], n=2, sampling=Sampling(max_tokens=4, seed=1), rollout_id="gate")
    assert [len(g.samples) for g in groups] == [2, 2]
    pushed = client.push_weights(str(tiny_dir), version="gate-pushed")
    assert pushed.version == "gate-pushed"
    openai = OpenAI(base_url=f"{held_server.url}/v1", api_key="unused")
    completion = openai.completions.create(model="tiny", prompt="hi", max_tokens=4, n=2)
    assert len(completion.choices) == 2
    chat = openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
