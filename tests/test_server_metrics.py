"""The server's Prometheus metrics: true to what the engine and the proposer did, bounded, per rollout."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from conftest import API_KEY
from samrollout.spec_decode.stats import ProposerStats
from samrollout.testing import ServerProcess
from support.weight_swap import swapping_weights

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics as 'name{labels}' -> value."""
    samples = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        match = SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def generate(server: ServerProcess, **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "temperature": 0, "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def drafter_stats(server: ServerProcess) -> ProposerStats:
    """The proposer's stats from /admin/status, read strictly (a missing or unknown key fails)."""
    return ProposerStats.from_json(httpx.get(f"{server.url}/admin/status", headers=AUTH, timeout=30).json()["drafter"])


def settle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and scrape(server).get("samrollout_requests_running", 1) != 0:
        time.sleep(0.3)


def test_every_metric_family_is_exported_with_base_units(tiny_server: ServerProcess) -> None:
    generate(tiny_server, prompt="metrics metrics metrics", max_tokens=24)
    settle(tiny_server)
    names = {key.split("{")[0] for key in scrape(tiny_server)}
    for family in ("spec_decode_drafts_total", "spec_decode_draft_tokens_total", "spec_decode_accepted_tokens_total",
                   "spec_decode_accepted_tokens_per_position_total", "spec_decode_acceptance_length_bucket",
                   "spec_decode_acceptance_rate", "drafter_step_seconds_bucket", "speculation_active",
                   "speculation_threshold", "speculation_k", "requests_running", "requests_waiting",
                   "request_latency_seconds_bucket", "time_to_first_token_seconds_bucket",
                   "time_per_output_token_seconds_bucket", "request_prompt_tokens_bucket",
                   "request_output_tokens_bucket", "requests_finished_total", "generated_tokens_total",
                   "weight_version_info", "drafter_source_draft_tokens_total",
                   "drafter_source_accepted_tokens_total", "drafter_global_tokens", "preemptions_total"):
        assert f"samrollout_{family}" in names, family
    assert not any(n.endswith("_created") for n in names if n.startswith("samrollout_"))


def engine_worker(server: ServerProcess) -> psutil.Process:
    """The server's vLLM worker process (it runs the model and the proposer)."""
    workers = [p for p in psutil.Process(server.process.pid).children(recursive=True)
               if "VLLM::Worker" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Worker")]
    assert len(workers) == 1, workers
    return workers[0]


def test_scraping_an_idle_server_leaves_its_engine_worker_idle(tiny_server: ServerProcess) -> None:
    # vLLM's worker busy-polls for a second after each call it gets; reading the drafter's stats is such a
    # call. An idle server scraped every half second must not be called at all: on a laptop, that core is
    # the trainer's.
    settle(tiny_server)
    scrape(tiny_server)
    time.sleep(1.5)  # any spin from the last real step is over
    worker = engine_worker(tiny_server)
    before = sum(worker.cpu_times()[:2])
    for _ in range(8):
        scrape(tiny_server)
        drafter_stats(tiny_server)
        time.sleep(0.5)
    assert sum(worker.cpu_times()[:2]) - before < 1.5  # calling it every time: about 4 CPU seconds


def test_engine_acceptance_counts_agree_with_what_the_proposer_proposed(tiny_server: ServerProcess) -> None:
    def snapshot() -> tuple[dict[str, float], ProposerStats]:
        settle(tiny_server)
        return scrape(tiny_server), drafter_stats(tiny_server)

    samples_before, drafter_before = snapshot()
    for i in range(4):
        generate(tiny_server, prompt=f"cross check {i} cross check {i} cross check", max_tokens=64)
    samples, drafter = snapshot()

    def delta(name: str) -> float:
        return total(samples, name) - total(samples_before, name)

    verified, accepted = delta("samrollout_spec_decode_draft_tokens_total"), delta(
        "samrollout_spec_decode_accepted_tokens_total")
    proposed = drafter.draft_tokens - drafter_before.draft_tokens
    # Every token the engine accepted was proposed and counted by the proposer, and no more.
    assert accepted == drafter.accepted_tokens - drafter_before.accepted_tokens > 0
    # ... and each accepted token is counted once, under the source that drafted it.
    assert delta("samrollout_drafter_source_accepted_tokens_total") == accepted
    assert delta("samrollout_drafter_source_draft_tokens_total") == proposed
    # The proposer also drafted after each request's last step, which nobody verifies: at most k per request.
    assert 0 <= proposed - verified <= drafter.k * 4
    by_position = [delta(f'samrollout_spec_decode_accepted_tokens_per_position_total{{position="{i}"}}')
                   for i in range(drafter.k)]
    assert sum(by_position) == accepted and by_position == sorted(by_position, reverse=True)
    lifetime = samples["samrollout_spec_decode_accepted_tokens_total"] / samples[
        "samrollout_spec_decode_draft_tokens_total"]
    assert abs(samples["samrollout_spec_decode_acceptance_rate"] - lifetime) < 1e-9


def test_workers_skip_rejection_sampling_in_steps_without_drafts(tiny_server: ServerProcess) -> None:
    assert drafter_stats(tiny_server).no_draft_sampling_patched is True


def test_per_request_acceptance_is_returned_in_the_response(tiny_server: ServerProcess) -> None:
    reply = generate(tiny_server, prompt="one two one two one two one two", max_tokens=48)
    spec = reply["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0 and 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]


def test_rollout_summary_and_histograms_follow_a_tagged_rollout(tiny_server: ServerProcess) -> None:
    lengths = [8] * 14 + [120, 240]  # a heavy tail: two long responses
    before = scrape(tiny_server)

    async def rollout() -> None:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            await client.post("/admin/pause", json={"mode": "keep"})  # all 16 in flight before any runs
            try:
                tasks = [asyncio.create_task(client.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"rollout {i}", "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "rollout_id": "metrics-rollout", "group_id": f"g{i % 4}"})) for i, n in enumerate(lengths)]
                while (await client.get("/admin/status")).json()["in_flight_requests"] < len(lengths):
                    await asyncio.sleep(0.05)
            finally:
                await client.post("/admin/resume")
            await asyncio.gather(*tasks)

    asyncio.run(rollout())
    deadline = time.monotonic() + 60  # the rollout ends after --rollout-idle-seconds (2 s) with nothing in flight
    while not (summary := httpx.get(f"{tiny_server.url}/v1/rollouts/metrics-rollout", headers=AUTH,
                                    timeout=30).json())["finished"]:
        assert time.monotonic() < deadline, summary
        time.sleep(0.2)
    assert summary["finished"] and summary["sequences"] == 16 and summary["in_flight"] == 0
    assert summary["output_tokens"] == sum(lengths) and summary["longest_tokens"] == 240
    assert summary["longest_to_median"] == 30.0 and summary["peak_in_flight"] == 16
    assert 0.0 < summary["tail_s"] < summary["makespan_s"] and 0.0 < summary["tail_share"] < 1.0
    assert summary["finish_reasons"] == {"length": 16}
    after = scrape(tiny_server)
    assert after["samrollout_rollout_makespan_seconds_count"] == before.get(
        "samrollout_rollout_makespan_seconds_count", 0) + 1
    assert after["samrollout_rollout_tail_share_count"] > before.get("samrollout_rollout_tail_share_count", 0)
    missing = httpx.get(f"{tiny_server.url}/v1/rollouts/never-seen", headers=AUTH, timeout=30)
    assert missing.status_code == 404


HISTORY_GROUPS = "samrollout_drafter_history_groups_total"
HISTORY_HITS = "samrollout_drafter_history_hit_groups_total"


def test_a_prompt_sent_again_in_a_later_rollout_is_one_history_hit_of_two_groups(tiny_server: ServerProcess) -> None:
    """Each group counts once, though its four siblings are four requests (as the client and veRL send them);
    the second rollout of the prompt finds the first one's responses in the server's history."""
    from samrollout_client import RolloutClient, Sampling

    prompt = f"history hit {uuid.uuid4().hex}: count to ten"  # new to this server's history
    settle(tiny_server)
    before = scrape(tiny_server)
    with RolloutClient(tiny_server.url, model="tiny", api_key=API_KEY) as client:
        for step in range(2):
            client.generate([prompt], n=4, sampling=Sampling(max_tokens=16, temperature=0),
                            rollout_id=f"history-hit-{step}-{uuid.uuid4().hex[:8]}")
    settle(tiny_server)
    after = scrape(tiny_server)
    assert after[HISTORY_GROUPS] - before[HISTORY_GROUPS] == 2
    assert after[HISTORY_HITS] - before[HISTORY_HITS] == 1


def test_http_errors_are_counted_by_status_code(tiny_server: ServerProcess) -> None:
    before = scrape(tiny_server).get('samrollout_http_errors_total{code="400"}', 0)
    httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "x", "n": 0})
    assert scrape(tiny_server)['samrollout_http_errors_total{code="400"}'] == before + 1


def test_served_weight_version_is_exported(tiny_server: ServerProcess) -> None:
    version = httpx.get(f"{tiny_server.url}/health", timeout=10).json()["weight_version"]
    samples = scrape(tiny_server)
    versions = [k for k in samples if k.startswith("samrollout_weight_version_info")]
    assert versions == [f'samrollout_weight_version_info{{version="{version}"}}']


def test_past_the_static_threshold_only_confident_drafts_are_made_and_the_tail_drafts(
        tiny_server: ServerProcess) -> None:
    lengths = [12] * 14 + [96, 96]  # 16 running at first (only confident drafts), then a tail of 2 (drafts)

    async def burst() -> None:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            await client.post("/admin/pause", json={"mode": "keep"})  # all 16 in flight before any runs
            try:
                tasks = [asyncio.create_task(client.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"tail {i} tail {i} tail {i} tail", "max_tokens": n,
                    "temperature": 0, "ignore_eos": True})) for i, n in enumerate(lengths)]
                while (await client.get("/admin/status")).json()["in_flight_requests"] < len(lengths):
                    await asyncio.sleep(0.05)
            finally:
                await client.post("/admin/resume")
            assert all(reply.status_code == 200 for reply in await asyncio.gather(*tasks))

    asyncio.run(burst())
    drafter = drafter_stats(tiny_server)
    # The server's default: confident drafts past the threshold, so the proposer applies the threshold itself
    # (vLLM's batch-size schedule would drop every draft there; tests/test_speculation_config_and_gate.py runs
    # that path on the real engine).
    assert drafter.threshold_mode == "static" and drafter.confident_match == 8
    assert drafter.threshold_from_vllm_schedule is False
    steps, drafting = drafter.steps_by_batch_size, drafter.drafting_steps_by_batch_size
    assert max(steps) > drafter.threshold  # the big batch ran ...
    assert any(size <= drafter.threshold for size in drafting)  # ... and the tail drafted
    # Every step that drafted past the threshold drafted a confident row (a match of 8+ tokens), at most k.
    assert sum(n for size, n in drafting.items() if size > drafter.threshold) <= drafter.confident_drafts
    assert drafter.longest_confident_draft <= drafter.confident_k == drafter.k



@pytest.fixture
def default_server(second_tiny_server: ServerProcess, tiny_dir: Path) -> Iterator[ServerProcess]:
    """The session's server with speculation at its defaults (drafts up to 32 tokens), left as it was found."""
    with swapping_weights(second_tiny_server, "metrics", tiny_dir, tiny_dir):
        yield second_tiny_server


def test_drafts_accepted_past_max_tokens_count_only_the_tokens_returned(default_server: ServerProcess) -> None:
    """A draft the model accepts beyond ``max_tokens`` is cut with the response: the request still succeeds and the
    rollout's token counts add up to what it returned (vLLM's per-request count includes the cut tokens)."""
    prompt, rollout = "past the end " * 6, f"overshoot-{uuid.uuid4().hex[:8]}"
    generate(default_server, prompt=prompt, max_tokens=96, rollout_id=rollout, group_id="g")  # a sibling to draft from
    before = scrape(default_server)
    reply = generate(default_server, prompt=prompt, max_tokens=3, rollout_id=rollout, group_id="g")
    assert reply["usage"]["completion_tokens"] == 3
    assert reply["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 3  # the draft ran past the end
    after = scrape(default_server)
    series = {source: f'samrollout_rollout_tokens_total{{source="{source}"}}' for source in ("draft", "model")}
    counted = {source: after[name] - before.get(name, 0) for source, name in series.items()}
    assert counted == {"draft": 2, "model": 1}  # the first token is never a draft
