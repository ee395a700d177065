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
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["START_TIMEOUT_S", "ServerProcess", "free_port", "start_command", "start_server"]

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
    """A running server: its URL, process and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

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
    return start_command(lambda port: [sys.executable, "-m", "samrollout.cli", "serve", "--port", str(port), *args],
                         log, env)


def start_command(command: Callable[[int], list[str]], log: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """Run the HTTP server ``command(free port)`` (ours or plain ``vllm serve``); return once /health is 200.

    The process runs in a session of its own (its workers are in its process group); see
    `start_server` for ``log``, ``env`` and the errors raised.
    """
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("wb")
    process = subprocess.Popen(command(port),
                               stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               start_new_session=True)  # its own process group: killpg ends its workers too
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"server did not answer within {START_TIMEOUT_S} s:\n{server.log_tail()}")
