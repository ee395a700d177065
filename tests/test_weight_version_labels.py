"""Weight versions that are true: every body, choice, streamed chunk and rollout summary names the weights
that sampled its tokens, across real weight updates ("wait", "abort", refused) on the shared tiny server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess
from support.frozen_engine import counter, frozen, rollout_in_flight, step_until, until
from support.weight_swap import WeightSwapper, swapping_weights

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = 400  # tokens of the requests kept running across an update (prompt + LONG within the 512 context)


@pytest.fixture(scope="module")
def weights(tiny_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path) -> Iterator[WeightSwapper]:
    """The weight swapper; the original weights (under the version served before) are back at the end."""
    with swapping_weights(tiny_server, "labels", tiny_dir, tiny_weights_v2) as swapper:
        yield swapper


def body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion request that runs its full length."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}


async def post(client: httpx.AsyncClient, request: dict[str, Any], route: str = "/v1/completions") -> dict[str, Any]:
    """A non-streamed reply's body (asserting 200)."""
    reply = await client.post(route, json=request)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def stream(client: httpx.AsyncClient, request: dict[str, Any], route: str = "/v1/completions",
                 after_first: asyncio.Event | None = None, hold: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """Every JSON chunk of a streamed reply; with ``hold``, stops reading after the first chunk (setting
    ``after_first``) until ``hold`` is set: a slow client."""
    chunks: list[dict[str, Any]] = []
    async with client.stream("POST", route, json={**request, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
                if hold is not None and after_first is not None and not after_first.is_set():
                    after_first.set()
                    await hold.wait()
    return chunks


async def update(client: httpx.AsyncClient, weights: WeightSwapper, version: str, in_flight: str) -> httpx.Response:
    """``POST /admin/update_weights`` loading the weights not served now; remembers them once loaded."""
    folder = weights.next_dir()
    reply = await client.post("/admin/update_weights",
                              json={"path": str(folder), "version": version, "in_flight": in_flight})
    if reply.status_code == 200:
        weights.loaded = folder
    return reply


def tokens_of(chunks: list[dict[str, Any]], index: int = 0) -> list[int]:
    """The token ids a stream gave choice ``index``."""
    return [t for c in chunks for choice in c.get("choices") or [] if choice.get("index", 0) == index
            for t in choice.get("token_ids") or []]


def versions_of(chunks: list[dict[str, Any]]) -> set[str]:
    """Every weight version a stream's chunks and their choices carry."""
    return ({c["weight_version"] for c in chunks}
            | {choice["weight_version"] for c in chunks for choice in c.get("choices") or []})


def client_for(server: ServerProcess) -> httpx.AsyncClient:
    """An async client of the server with the API key and room for many requests at once."""
    return httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300,
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


async def running_requests(client: httpx.AsyncClient, rollout: str, count: int) -> None:
    """Wait until ``count`` requests of ``rollout`` are in flight (the API process of a loaded 2-core
    machine once took more than a minute to take eight)."""

    async def arrived() -> bool:
        return await rollout_in_flight(client, rollout) >= count

    await until(arrived, f"the requests of {rollout} to reach the server")


async def started_frozen(client: httpx.AsyncClient, rollout: str, count: int, generated: float) -> None:
    """On an engine frozen before they were sent: wait for the ``count`` sequences of ``rollout`` to arrive,
    then run the engine a step at a time until each may have a token (``generated``: the token counter before).

    Frozen, they cannot end before the update the test sends next lands, however slow or fast this machine.
    """
    await running_requests(client, rollout, count)

    async def generating() -> bool:
        return await counter(client) >= generated + count

    await step_until(client, generating)


async def wait_update_holding(client: httpx.AsyncClient, weights: WeightSwapper,
                              version: str) -> asyncio.Task[httpx.Response]:
    """Start a "wait" update on the frozen engine; return once its pause holds new requests.

    The "wait" pause lets the frozen sequences run on to their end, so the engine's token
    counter moving again says the pause has landed: a request sent from then on queues
    and runs on the new weights.
    """
    held_at = await counter(client)
    updating = asyncio.create_task(update(client, weights, version, "wait"))

    async def draining() -> bool:
        return await counter(client) > held_at

    await until(draining, "the update's pause to let the frozen requests run on")
    return updating


def test_a_request_sent_during_a_wait_update_says_the_new_version_streamed_or_not(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    # The reported bug: the stream said the previous version although the new weights produced it.
    old, new = admin_status(tiny_server)["weight_version"], weights.new_version("repro")
    probe = body("the probe prompt", 24)

    async def scenario() -> tuple[list[dict[str, Any]], httpx.Response, dict[str, Any], list[dict[str, Any]]]:
        async with client_for(tiny_server) as client:
            generated = await counter(client)
            async with frozen(client):  # resumed after, even if the test fails
                load = [asyncio.create_task(post(client, body(f"keep busy {i}", LONG, rollout_id="repro-load")))
                        for i in range(8)]
                await started_frozen(client, "repro-load", 8, generated)
                updating = await wait_update_holding(client, weights, new)
                plain, streamed = await asyncio.gather(post(client, probe), stream(client, probe))
                return list(await asyncio.gather(*load)), await updating, plain, streamed

    load, updated, plain, streamed = asyncio.run(scenario())
    assert updated.status_code == 200, updated.text
    assert {r["weight_version"] for r in load} == {old}  # "wait": they finished on the old weights
    assert all(c["weight_version"] == old for r in load for c in r["choices"])
    assert plain["weight_version"] == new and versions_of(streamed) == {new}
    assert tokens_of(streamed) == plain["choices"][0]["token_ids"]
    after = httpx.post(f"{tiny_server.url}/v1/completions", json=probe, headers=AUTH, timeout=60).json()
    assert after["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]  # the new weights made both
    summary = httpx.get(f"{tiny_server.url}/v1/rollouts/repro-load", headers=AUTH, timeout=30).json()
    assert summary["weight_versions"] == {old: 8}


def test_a_slow_stream_read_after_a_wait_update_keeps_the_old_version_in_every_chunk(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    old, new = admin_status(tiny_server)["weight_version"], weights.new_version("slow")
    request = body("a stream that straddles the update", 200)
    expected = httpx.post(f"{tiny_server.url}/v1/completions", json=request, headers=AUTH, timeout=120).json()

    async def scenario() -> tuple[list[dict[str, Any]], httpx.Response]:
        async with client_for(tiny_server) as client:
            first, hold = asyncio.Event(), asyncio.Event()
            reading = asyncio.create_task(stream(client, request, after_first=first, hold=hold))
            await first.wait()
            updated = await update(client, weights, new, "wait")  # the client reads nothing meanwhile
            hold.set()
            return await reading, updated

    chunks, updated = asyncio.run(scenario())
    assert updated.status_code == 200, updated.text
    assert expected["weight_version"] == old
    assert versions_of(chunks) == {old}
    assert tokens_of(chunks) == expected["choices"][0]["token_ids"]  # the old weights made every token


def test_requests_aborted_by_an_abort_update_carry_the_old_version(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    old, new = admin_status(tiny_server)["weight_version"], weights.new_version("abort")

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], httpx.Response, dict[str, Any]]:
        async with client_for(tiny_server) as client:
            extra = {"rollout_id": "aborted-by-update"}
            generated = await counter(client)
            async with frozen(client):  # resumed after, even if the test fails
                plain = [asyncio.create_task(post(client, body(f"aborted {i}", LONG, **extra))) for i in range(3)]
                streamed = asyncio.create_task(stream(client, body("aborted stream", LONG, n=2, temperature=1.0, seed=2,
                                                                   **extra)))
                await started_frozen(client, "aborted-by-update", 5, generated)
                updated = await update(client, weights, new, "abort")
                after = await post(client, body("after the abort update", 8))
                return list(await asyncio.gather(*plain)), await streamed, updated, after

    plain, streamed, updated, after = asyncio.run(scenario())
    assert updated.status_code == 200, updated.text
    assert all(r["choices"][0]["finish_reason"] == "abort" and r["weight_version"] == old for r in plain)
    assert all(r["choices"][0]["weight_version"] == old for r in plain)
    assert versions_of(streamed) == {old}
    assert after["weight_version"] == new
    summary = httpx.get(f"{tiny_server.url}/v1/rollouts/aborted-by-update", headers=AUTH, timeout=30).json()
    assert summary["weight_versions"] == {old: 5} and summary["finish_reasons"] == {"abort": 5}


def test_every_choice_of_n_above_one_is_labelled_old_in_flight_and_new_when_queued_across_the_update(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    old, new = admin_status(tiny_server)["weight_version"], weights.new_version("n")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "queued chat"}], "max_tokens": 12,
            "ignore_eos": True, "temperature": 1.0, "seed": 3, "n": 3, "rollout_id": "queued-n"}

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], dict[str, Any],
                                  list[dict[str, Any]]]:
        async with client_for(tiny_server) as client:
            generated = await counter(client)
            async with frozen(client):  # resumed after, even if the test fails
                before = asyncio.create_task(post(client, body("in flight n", LONG, n=3, temperature=1.0, seed=1,
                                                         rollout_id="inflight-n")))
                before_stream = asyncio.create_task(stream(client, body("in flight n stream", LONG, n=3,
                                                                        temperature=1.0, seed=2,
                                                                        rollout_id="inflight-n")))
                await started_frozen(client, "inflight-n", 6, generated)
                updating = await wait_update_holding(client, weights, new)  # it waits for the six above: these queue
                queued = asyncio.create_task(post(client, body("queued n", 12, n=3, temperature=1.0, seed=5,
                                                                rollout_id="queued-n")))
                queued_stream = asyncio.create_task(stream(client, chat, "/v1/chat/completions"))
                queued_chat = await post(client, {**chat, "seed": 4}, "/v1/chat/completions")
                assert (await updating).status_code == 200
                return await before, queued_chat, await before_stream, await queued, await queued_stream

    before, queued_chat, before_stream, queued, queued_stream = asyncio.run(scenario())
    assert before["weight_version"] == old and [c["weight_version"] for c in before["choices"]] == [old] * 3
    assert versions_of(before_stream) == {old} and all(tokens_of(before_stream, i) for i in range(3))
    for reply in (queued, queued_chat):
        assert reply["weight_version"] == new and [c["weight_version"] for c in reply["choices"]] == [new] * 3
    assert versions_of(queued_stream) == {new}
    rollouts = {r: httpx.get(f"{tiny_server.url}/v1/rollouts/{r}", headers=AUTH, timeout=30).json()
                for r in ("inflight-n", "queued-n")}
    assert rollouts["inflight-n"]["weight_versions"] == {old: 6}
    assert rollouts["queued-n"]["weight_versions"] == {new: 9}


def test_a_refused_update_leaves_every_label_at_the_serving_version(
        tiny_server: ServerProcess, weights: WeightSwapper, tmp_path: Path) -> None:
    current = admin_status(tiny_server)["weight_version"]

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], httpx.Response, dict[str, Any]]:
        async with client_for(tiny_server) as client:
            plain = asyncio.create_task(post(client, body("during a refused update", 120)))
            streamed = asyncio.create_task(stream(client, body("streamed during a refused update", 120)))
            await asyncio.sleep(0.3)
            refused = await client.post("/admin/update_weights",
                                        json={"path": str(tmp_path), "version": "never-served", "in_flight": "wait"})
            after = await post(client, body("after a refused update", 8))
            return await plain, await streamed, refused, after

    plain, streamed, refused, after = asyncio.run(scenario())
    assert refused.status_code == 400
    assert plain["weight_version"] == current and versions_of(streamed) == {current}
    assert after["weight_version"] == current and admin_status(tiny_server)["weight_version"] == current
