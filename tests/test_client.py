"""The trainer-side client against real servers: order, groups, retries, abort, weights, errors, install."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from conftest import API_KEY, TINY_SERVER_MEMORY, admin_status
from samrollout_client import AsyncRolloutClient, RolloutClient, RolloutFailed, Sampling
from server_process import ServerProcess, start_server

CLIENTS = Path(__file__).resolve().parent.parent / "clients"


def tiny_args(tiny_dir: Path) -> list[str]:
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY, "--max-model-len", "512",
            "--dtype", "float32", "--gpu-memory-utilization", str(TINY_SERVER_MEMORY), "--", "--enforce-eager"]


@pytest.fixture(scope="module")
def second_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    server = start_server(tiny_args(tiny_dir), tmp_path_factory.mktemp("second") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def client(tiny_server: ServerProcess):  # type: ignore[no-untyped-def]
    with RolloutClient(tiny_server.url, model="tiny", api_key=API_KEY, max_in_flight=16) as rollout_client:
        yield rollout_client


def test_generate_returns_n_samples_per_prompt_in_input_order(client: RolloutClient) -> None:
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(5)]
    groups = client.generate(prompts, n=4, sampling=Sampling(max_tokens=12, seed=3), rollout_id="client-order")
    assert [g.index for g in groups] == list(range(5)) and [g.prompt for g in groups] == prompts
    for group in groups:
        assert len(group.samples) == 4 and len({g.group_id for g in groups}) == 5
        for sample in group.samples:
            assert len(sample.token_ids) == 12 and sample.text and sample.weight_version
            assert sample.finish_reason == "length" and sample.attempts == 1
    again = client.generate(prompts, n=4, sampling=Sampling(max_tokens=12, seed=3), rollout_id="client-order-2")
    assert [[s.token_ids for s in g.samples] for g in again] == [[s.token_ids for s in g.samples] for g in groups]
    assert len({tuple(s.token_ids) for s in groups[0].samples}) > 1  # seed + i: siblings differ


def test_rollout_report_counts_every_sample_of_the_rollout(client: RolloutClient) -> None:
    client.generate(["a", "b", "c"], n=4, sampling=Sampling(max_tokens=10, temperature=0), rollout_id="client-report")
    time.sleep(2.5)  # the server closes a rollout 2 s after its last response
    report = client.report("client-report")
    assert report.sequences == 12 and report.output_tokens == 120 and report.finish_reasons == {"length": 12}
    assert report.makespan_s > 0 and 0 < report.tail_share <= 1 and "client-report" in str(report)
    assert report.model_dump()["endpoints"] == 1


def test_greedy_samples_carry_per_request_speculation_stats(client: RolloutClient) -> None:
    groups = client.generate(["one two one two one two one two"], n=2,
                             sampling=Sampling(max_tokens=48, temperature=0), rollout_id="client-spec")
    stats = [s.speculation for s in groups[0].samples]
    assert all(s is not None and s.num_draft_tokens > 0 for s in stats)


def test_groups_spread_over_two_endpoints_with_siblings_together(tiny_server: ServerProcess,
                                                                 second_server: ServerProcess) -> None:
    async def run() -> list[set[str]]:
        async with AsyncRolloutClient([tiny_server.url, second_server.url], model="tiny", api_key=API_KEY,
                                      max_in_flight=8) as client:
            groups = await client.generate([f"spread {i}" for i in range(8)], n=3,
                                           sampling=Sampling(max_tokens=24, temperature=0), rollout_id="spread")
            return [{s.endpoint for s in g.samples} for g in groups]

    endpoints = asyncio.run(run())
    assert all(len(e) == 1 for e in endpoints)  # a group's siblings share one server
    assert set().union(*endpoints) == {tiny_server.url, second_server.url}


def test_predicted_work_placement_balances_the_remembered_lengths_over_two_endpoints(
        tiny_server: ServerProcess, second_server: ServerProcess) -> None:
    """First rollout: lengths learned; second: the long groups are split, not stacked on one server."""
    lengths = [200, 190, 20, 20, 20, 20]  # enforced through max_tokens here, one rollout per length set

    async def run() -> list[str]:
        async with AsyncRolloutClient([tiny_server.url, second_server.url], model="tiny", api_key=API_KEY,
                                      max_in_flight=32, placement="predicted-work") as client:
            prompts = [f"placement {i}" for i in range(len(lengths))]
            for prompt, length in zip(prompts, lengths, strict=True):
                await client.generate([prompt], n=2, sampling=Sampling(max_tokens=length, temperature=0,
                                                                       extra={"ignore_eos": True}))
            assert len(client.history) == len(prompts)
            groups = await client.generate(prompts, n=2, sampling=Sampling(max_tokens=8, temperature=0),
                                           rollout_id="placement")
            assert all(len({s.endpoint for s in g.samples}) == 1 for g in groups)
            return [g.samples[0].endpoint for g in groups]

    endpoints = asyncio.run(run())
    assert endpoints[0] != endpoints[1]  # the two long groups on different servers
    assert endpoints[2:].count(endpoints[0]) == 2 and endpoints[2:].count(endpoints[1]) == 2


def test_predicted_work_places_the_longest_group_first_on_the_least_loaded_endpoint() -> None:
    from samrollout_client.placement import place_by_predicted_work

    assert place_by_predicted_work([100, 90, 50, 40], 2) == [0, 1, 1, 0]
    assert place_by_predicted_work([None, 300, 100], 2) == [1, 0, 1]  # unknown: the mean of the known (200)
    assert place_by_predicted_work([10, 10], 2, load=[0, 500]) == [0, 0]
    with pytest.raises(ValueError):
        AsyncRolloutClient("http://127.0.0.1:1", model="m", placement="random")  # type: ignore[arg-type]


def _kill_once_holding(server: ServerProcess, timeout: float = 120.0) -> None:
    """SIGKILL ``server`` once it holds requests of the rollout (a crash mid-rollout, whatever the machine's speed).

    The server is paused ("keep"), so what reached it cannot finish before the kill.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if admin_status(server)["in_flight_requests"] >= 1:
            break
        time.sleep(0.02)
    server.kill()


def test_a_server_killed_mid_rollout_has_its_samples_retried_elsewhere(tiny_server: ServerProcess, tiny_dir: Path,
                                                                       tmp_path: Path) -> None:
    doomed = start_server(tiny_args(tiny_dir), tmp_path / "doomed.log")
    try:
        paused = httpx.post(f"{doomed.url}/admin/pause", json={"mode": "keep"},
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert paused.status_code == 200, paused.text
        with RolloutClient([tiny_server.url, doomed.url], model="tiny", api_key=API_KEY, max_in_flight=32,
                           backoff_s=0.2) as client:
            killer = threading.Thread(target=_kill_once_holding, args=(doomed,))
            killer.start()
            groups = client.generate([f"survive {i}" for i in range(8)], n=4,
                                     sampling=Sampling(max_tokens=300, temperature=0, extra={"ignore_eos": True}),
                                     rollout_id="survive")
            killer.join()
    finally:
        doomed.stop()
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 32 and all(len(s.token_ids) == 300 for s in samples)
    retried = [s for s in samples if s.attempts > 1]
    assert retried and all(s.endpoint == tiny_server.url for s in retried)


def test_abort_ends_a_running_rollout_with_partial_samples(tiny_server: ServerProcess) -> None:
    async def run() -> tuple[int, list[str | None]]:
        async with AsyncRolloutClient(tiny_server.url, model="tiny", api_key=API_KEY) as client:
            await client.pause("keep")  # hold the rollout in the server, so the abort surely finds it running
            try:
                task = asyncio.create_task(client.generate(["abort me"], n=4, rollout_id="client-abort",
                                                           sampling=Sampling(max_tokens=480)))
                await wait_in_flight(tiny_server, "client-abort", 4)
                aborted = await client.abort("client-abort")
            finally:
                await client.resume()
            groups = await task
            return aborted, [s.finish_reason for s in groups[0].samples]

    aborted, reasons = asyncio.run(run())
    assert aborted == 4 and reasons == ["abort"] * 4


async def wait_in_flight(server: ServerProcess, rollout_id: str, count: int) -> None:
    import httpx

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for _ in range(200):
            reply = await http.get(f"{server.url}/v1/rollouts/{rollout_id}")
            if reply.status_code == 200 and reply.json()["in_flight"] >= count:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{count} requests never reached the server")


def test_weight_update_is_visible_in_the_returned_version(tiny_server: ServerProcess, second_server: ServerProcess,
                                                          tiny_dir: Path) -> None:
    with RolloutClient([tiny_server.url, second_server.url], model="tiny", api_key=API_KEY) as client:
        client.update_weights(str(tiny_dir), "client-v7")
        groups = client.generate([f"version {i}" for i in range(4)], n=2, sampling=Sampling(max_tokens=4))
    assert {s.weight_version for g in groups for s in g.samples} == {"client-v7"}


def test_bad_arguments_are_rejected_with_clear_errors(client: RolloutClient) -> None:
    with pytest.raises(ValueError, match="n must be at least 1"):
        client.generate(["x"], n=0)
    with pytest.raises(ValueError, match="prompt 1 must be"):
        client.generate(["x", []], n=1)
    with pytest.raises(ValidationError):
        Sampling(max_tokens=0)
    with pytest.raises(RolloutFailed, match=r"group 1 sample 0: .*rejected the request \(400\)") as failed:
        client.generate(["fine", "hello " * 600], n=1, sampling=Sampling(max_tokens=4))
    assert len(failed.value.partial[0].samples) == 1 and failed.value.partial[1].samples == []


def test_overall_timeout_names_the_missing_samples(client: RolloutClient) -> None:
    client.pause("keep")  # nothing can finish: the timeout surely fires first
    try:
        with pytest.raises(RolloutFailed, match=r"not finished within 0\.5 s") as failed:
            client.generate(["slow"], n=2, timeout_s=0.5, rollout_id="client-timeout",
                            sampling=Sampling(max_tokens=64, temperature=0))
    finally:
        client.resume()
    assert {(f.group, f.sample) for f in failed.value.failures} == {(0, 0), (0, 1)}


def test_client_package_installs_alone_without_vllm_or_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(CLIENTS)], check=True, timeout=600,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    check = ("import sys, samrollout_client; assert samrollout_client.RolloutClient; "
             "bad = {'vllm', 'torch', 'samrollout'} & set(sys.modules); assert not bad, bad")
    subprocess.run([str(python), "-c", check], check=True)
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout.lower()
    assert "vllm" not in listed and "torch" not in listed
