"""``/health`` latency measured from a process of its own, beside a do-nothing control server's.

A soak's load generator runs hundreds of requests in one event loop; a health check timed on that loop
counts the loop's own lag as the server's.  `HealthProbe` times ``/health`` from a separate process (a
blocking client, nothing else on its thread) and, at the same moments, a control server that does no
work at all (the standard library's HTTP server, in another process).  On a busy 2-core machine the
control shows what scheduling alone costs; the server's own share is its latency above the control's.
"""

from __future__ import annotations

import http.server
import json
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import httpx

from harness import percentile
from samrollout.testing import free_port

FAILED_S = 60.0  # the latency recorded for a failed check or a non-200


class _Ok(http.server.BaseHTTPRequestHandler):
    """Answers every GET with an empty 200: the control's whole job."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the soak's output is its table."""


def _serve_control(port: int) -> None:
    http.server.ThreadingHTTPServer(("127.0.0.1", port), _Ok).serve_forever()


def _time_get(http_client: httpx.Client, url: str) -> float:
    start = time.perf_counter()
    try:
        ok = http_client.get(url).status_code == 200
    except httpx.HTTPError:
        ok = False
    return time.perf_counter() - start if ok else FAILED_S


def _probe(server_url: str, control_url: str, every_s: float, stop: Event, out: str) -> None:
    """Until ``stop``: time the server's ``/health`` and the control's, one after the other; write them to ``out``."""
    checks: list[dict[str, float]] = []
    start = time.perf_counter()
    with httpx.Client(timeout=FAILED_S) as server, httpx.Client(timeout=FAILED_S) as control:
        while not stop.is_set():
            checks.append({"t_s": round(time.perf_counter() - start, 3),
                           "health_s": _time_get(server, f"{server_url}/health"),
                           "control_s": _time_get(control, f"{control_url}/health")})
            stop.wait(every_s)
    Path(out).write_text(json.dumps(checks))


@dataclass
class HealthProbe:
    """The probe and control processes of one soak: `start`, then `stop` for every check's two latencies."""

    server_url: str
    out: Path
    every_s: float = 0.5

    def start(self) -> None:
        """Start the control server and the probe (they run until `stop`)."""
        context = multiprocessing.get_context("spawn")
        port = free_port()
        self._control = context.Process(target=_serve_control, args=(port,), daemon=True)
        self._control.start()
        self._stop = context.Event()
        self._probe = context.Process(target=_probe, args=(self.server_url, f"http://127.0.0.1:{port}",
                                                           self.every_s, self._stop, str(self.out)), daemon=True)
        self._probe.start()

    def stop(self) -> list[dict[str, float]]:
        """Stop both; every check: ``t_s``, the server's ``health_s`` and the control's ``control_s``."""
        self._stop.set()
        self._probe.join(timeout=2 * FAILED_S + 10)
        self._control.terminate()
        self._control.join(timeout=10)
        return list(json.loads(self.out.read_text())) if self.out.exists() else []


def summarise_checks(checks: list[dict[str, float]]) -> dict[str, Any]:
    """Worst and p99 of the server's and the control's latencies, and the server's worst excess over the control
    at the same check (what the server itself added)."""
    def p99(values: list[float]) -> float | None:
        return percentile(values, 0.99) if values else None

    health = [c["health_s"] for c in checks]
    control = [c["control_s"] for c in checks]
    return {"health_checks": len(checks), "worst_health_s": max(health, default=None), "p99_health_s": p99(health),
            "worst_control_s": max(control, default=None), "p99_control_s": p99(control),
            "worst_health_over_control_s": max((c["health_s"] - c["control_s"] for c in checks), default=None),
            "health_over_1s": sum(h > 1.0 for h in health), "control_over_1s": sum(c > 1.0 for c in control)}
