"""Start `samrollout serve` (or another HTTP server) as a real subprocess, wait until it answers, stop it.

The tests (``tests/``) and the benchmarks (``bench/``) both run servers this way::

    from samrollout.testing import start_server

    server = start_server(["--served-model-name", "bench"], Path("/tmp/server.log"))
    try:
        httpx.get(f"{server.url}/v1/models")
    finally:
        server.stop()

Each server gets a free port on 127.0.0.1 and its own process group, so that `ServerProcess.stop`
and `ServerProcess.kill` also end the engine processes it started.  Its output (stdout and
stderr) goes to a log file, whose tail start-up errors quote.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["START_TIMEOUT_S", "ServerProcess", "free_port", "launch_command", "launch_server", "start_command",
           "start_prometheus", "start_server"]

START_TIMEOUT_S = 600.0
"""How long a server may take to answer ``GET /health`` with 200 (model load, engine start-up)."""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    """A running server: its URL, process and log file (and, until it is ready, where and since when to ask)."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path
    ready_path: str = "/health"
    started: float = 0.0  # time.monotonic() at its launch

    def ready(self) -> ServerProcess:
        """This server once its ready path answers 200 (at most `START_TIMEOUT_S` after its launch).

        Raises `RuntimeError` (with the log's tail) if it exits first or never answers (it is then stopped).
        """
        deadline = self.started + START_TIMEOUT_S
        while True:  # asked at least once: a server launched long before it is needed may be ready
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"server did not answer within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        """The last ``chars`` characters of the server's log."""
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, wait for a clean exit (else kill everything); returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._kill_group()  # whatever an abrupt end left behind (engine core, workers)
        return int(self.process.returncode)

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once, as a crash would end them."""
        self._kill_group()
        self.process.wait()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """Run ``samrollout serve ARGS --port <free>`` and return once /health answers 200.

    ``log`` receives the server's output; ``env`` is added to this process's environment.
    Raises `RuntimeError` (with the log's tail) if the server exits or does not answer within
    `START_TIMEOUT_S`.
    """
    return launch_server(args, log, env).ready()


def launch_server(args: list[str], log: Path, env: dict[str, str] | None = None,
                  port: int | None = None) -> ServerProcess:
    """Start ``samrollout serve ARGS --port <free>`` and return at once: `ServerProcess.ready` waits for it.

    For starting several servers side by side (each start is mostly single-threaded imports).
    ``port``: one chosen beforehand (servers that name each other, e.g. in ``--weight-peers``).
    """
    return launch_command(lambda port: [sys.executable, "-m", "samrollout.cli", "serve", "--port", str(port), *args],
                          log, env, port=port)


def start_command(command: Callable[[int], list[str]], log: Path, env: dict[str, str] | None = None,
                  ready_path: str = "/health") -> ServerProcess:
    """Run the HTTP server ``command(free port)`` (ours, plain ``vllm serve``, Prometheus); return once its
    ``ready_path`` answers 200 (see `start_server` for ``log``, ``env`` and the errors raised)."""
    return launch_command(command, log, env, ready_path).ready()


def launch_peered_servers(count: int, args: list[str], logs: list[Path],
                          env: dict[str, str] | None = None) -> list[ServerProcess]:
    """Start ``count`` servers (`launch_server`, not yet ready), each naming all the others in ``--weight-peers``
    (none with one server): relayed weight pushes. ``logs[i]`` receives server i's output."""
    ports = [free_port() for _ in range(count)]
    launched = []
    for port, log in zip(ports, logs, strict=True):
        peers = ",".join(f"http://127.0.0.1:{p}" for p in ports if p != port)
        launched.append(launch_server([*args, *(["--weight-peers", peers] if peers else [])], log, env, port=port))
    return launched


def launch_command(command: Callable[[int], list[str]], log: Path, env: dict[str, str] | None = None,
                   ready_path: str = "/health", port: int | None = None) -> ServerProcess:
    """Start the HTTP server ``command(port)`` (a free one unless given) and return at once; `ServerProcess.ready`
    waits for it.

    The process runs in a session of its own (its workers are in its process group).
    """
    port = port or free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("wb")
    process = subprocess.Popen(command(port),
                               stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               start_new_session=True)  # its own process group: killpg ends its workers too
    return ServerProcess(f"http://127.0.0.1:{port}", process, log, ready_path, time.monotonic())


def start_prometheus(targets: list[str], work: Path, rules: Path | None = None,
                     scrape_seconds: float = 1.0) -> ServerProcess:
    """A real Prometheus (the ``prometheus`` binary) scraping ``targets`` (``host:port``) as job ``samrollout``.

    It scrapes and evaluates ``rules`` every ``scrape_seconds`` and keeps its data under ``work``;
    returns once it is ready.  Raises `RuntimeError` when the binary is missing.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("the prometheus binary is missing: apt-get install prometheus (make test does)")
    work.mkdir(parents=True, exist_ok=True)
    config = work / "prometheus.yml"
    interval = f"{scrape_seconds:g}s"
    config.write_text(f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
                      + (f"rule_files:\n  - {json.dumps(str(rules))}\n" if rules else "")
                      + "scrape_configs:\n  - job_name: samrollout\n    static_configs:\n"
                      + f"      - targets: {json.dumps(targets)}\n")
    return start_command(lambda port: [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                         work / "prometheus.log", ready_path="/-/ready")
