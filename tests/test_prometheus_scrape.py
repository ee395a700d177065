"""A real Prometheus server scrapes the running samrollout server; its API must return our series.

Needs the ``prometheus`` binary (Debian package ``prometheus``; `make test` installs it).
Every query of the Grafana dashboard (`deploy/grafana/dashboard.py`) must return data: the
traffic includes a ``continue`` and a ``continue-keep-kv`` weight update, each with a request
generating (the same weights under new versions; the server's version is restored after).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from conftest import API_KEY
from samrollout.testing import ServerProcess, start_prometheus
from support.frozen_engine import counter, freeze, in_flight_at_least, step_until, until
from support.weight_swap import WeightSwapper, swapping_weights

ROOT = Path(__file__).resolve().parent.parent
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard, as Grafana would send it (1m for its interval variables)."""
    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy" / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    queries: list[str] = module.all_queries()
    return [q.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "5m")
            for q in queries]


@pytest.fixture(scope="module")
def prometheus(tiny_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus scraping the shared server every second, with deploy/prometheus/rules.yml: its URL."""
    server = start_prometheus([urlparse(tiny_server.url).netloc], tmp_path_factory.mktemp("prometheus"),
                              ROOT / "deploy" / "prometheus" / "rules.yml")
    yield server.url
    server.stop(timeout=30)


def query(prometheus_url: str, expression: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expression}, timeout=30).json()
    assert reply["status"] == "success", (expression, reply)
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def wait_for(prometheus_url: str, expression: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(prometheus_url, expression)
        if result:
            return result
        time.sleep(1.0)
    raise AssertionError(f"no data for {expression!r} after {timeout} s")


def send_traffic(server: ServerProcess) -> None:
    """Greedy repetitive requests (speculation runs), a tagged rollout, and one bad request."""
    for i in range(6):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
            "model": "tiny", "prompt": f"scrape {i} scrape {i} scrape", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "rollout_id": "scraped-rollout"})
    httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30, json={"model": "tiny", "prompt": "x", "n": 0})


def test_prometheus_scrapes_acceptance_latency_and_rollout_series(tiny_server: ServerProcess, prometheus: str) -> None:
    wait_for(prometheus, 'up{job="samrollout"} == 1')
    send_traffic(tiny_server)
    accepted = wait_for(prometheus, "samrollout_spec_decode_accepted_tokens_total > 0")
    assert float(accepted[0]["value"][1]) > 0
    time.sleep(3.0)  # a few more scrapes, so rates over the window have two points
    send_traffic(tiny_server)
    rate = wait_for(prometheus, "increase(samrollout_spec_decode_accepted_tokens_total[1m]) "
                                "/ increase(samrollout_spec_decode_draft_tokens_total[1m])")
    assert 0.0 < float(rate[0]["value"][1]) <= 1.0
    p99 = wait_for(prometheus, "histogram_quantile(0.99, sum by (le) "
                               "(rate(samrollout_request_latency_seconds_bucket[1m])))")
    assert float(p99[0]["value"][1]) > 0
    wait_for(prometheus, "samrollout_rollout_makespan_seconds_count > 0", timeout=30)
    wait_for(prometheus, 'samrollout_http_errors_total{code="400"} > 0')


@pytest.fixture(scope="module")
def weights(tiny_server: ServerProcess, tiny_dir: Path) -> Iterator[WeightSwapper]:
    """The shared server, given its own weights under new versions here; its version is restored after."""
    with swapping_weights(tiny_server, "scrape", tiny_dir, tiny_dir) as swapper:
        yield swapper


@pytest.fixture(scope="module")
def updated(tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    """Once for the module: the weight update series the dashboard and the rules read have data."""
    continue_updates(tiny_server, weights)


def continue_updates(server: ServerProcess, weights: WeightSwapper) -> None:
    """A ``continue`` and a ``continue-keep-kv`` update, each landing a few tokens into a request (frozen engine)."""
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as client:
            for mode in ("continue", "continue-keep-kv"):
                generated = await counter(client)
                await freeze(client)
                request = asyncio.create_task(client.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"update {mode}", "max_tokens": 32, "ignore_eos": True,
                    "temperature": 0}))
                await until(lambda: in_flight_at_least(client, 1), "the request to arrive")

                async def generating(before: float = generated) -> bool:
                    return await counter(client) > before

                await step_until(client, generating)
                reply = await client.post("/admin/update_weights", json={
                    "path": str(weights.loaded), "version": weights.new_version(mode), "in_flight": mode})
                assert reply.status_code == 200 and reply.json()["continued_requests"] == 1, reply.text
                assert (await request).status_code == 200

    asyncio.run(scenario())


@pytest.mark.usefixtures("updated")
def test_every_dashboard_query_returns_data_from_the_live_server(tiny_server: ServerProcess, prometheus: str) -> None:
    send_traffic(tiny_server)
    time.sleep(3.0)
    empty = []
    for expression in dashboard_queries():
        try:
            wait_for(prometheus, expression, timeout=20)
        except AssertionError:
            empty.append(expression)
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


@pytest.mark.usefixtures("updated")
def test_recording_rules_are_evaluated(tiny_server: ServerProcess, prometheus: str) -> None:
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules and all(rule.get("health") in ("ok", "unknown") for rule in rules), rules
    recording = [rule["name"] for rule in rules if rule["type"] == "recording"]
    send_traffic(tiny_server)
    for name in recording:
        if "acceptance" in name or "weight_update" in name:
            wait_for(prometheus, name, timeout=30)
