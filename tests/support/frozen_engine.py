"""Hold a server's engine still and run it a few steps at a time, so a test can act mid-generation.

On a loaded machine, a test that lets requests run and then reacts to what it sees from outside
(a metric, a status) can find them already finished. These helpers freeze the engine before the
requests arrive (``/admin/pause`` "keep" ends nothing; new requests wait in the engine), and then
run it in short bursts until a condition holds, so what the test does next lands a few steps in.
Pausing between steps does not change what a step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

GENERATED = "vllm:generation_tokens_total"


async def freeze(client: httpx.AsyncClient) -> None:
    """``/admin/pause`` "keep": the engine stops at a step boundary, ending nothing; new requests wait."""
    assert (await client.post("/admin/pause", json={"mode": "keep"})).status_code == 200


@contextlib.asynccontextmanager
async def frozen(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """`freeze` on entry; resumed on exit however the block ends, so a failed test leaves the server serving."""
    await freeze(client)
    try:
        yield
    finally:
        await client.post("/admin/resume")


async def in_flight_at_least(client: httpx.AsyncClient, count: int) -> bool:
    """At least ``count`` requests are in flight over HTTP (frozen requests count: they wait in the engine)."""
    status = (await client.get("/admin/status", params={"drafter": "false"})).json()
    return int(status["in_flight_requests"]) >= count


async def rollout_in_flight(client: httpx.AsyncClient, rollout: str) -> int:
    """How many sequences of ``rollout`` are in flight (0 before the server has seen it)."""
    reply = await client.get(f"/v1/rollouts/{rollout}")
    return int(reply.json()["in_flight"]) if reply.status_code == 200 else 0


async def counter(client: httpx.AsyncClient, name: str = GENERATED) -> float:
    """The first /metrics sample named ``name`` (0 when none is exported yet)."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout: float = 180.0) -> None:
    """Poll the async ``condition()`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def run_in_bursts(client: httpx.AsyncClient, done: Callable[[], Awaitable[bool]]) -> None:
    """Run the frozen engine in short bursts (resumed, frozen again) until ``done()``; it is frozen after.

    The first burst is 20 ms, a few steps of the tiny model. After each burst the condition has up to a
    second to show (a stream's chunk can reach its client late on a loaded machine); a burst is doubled
    only when the engine generated nothing in it, so a slow reader never earns a burst long enough to
    run a request to its end.
    """
    burst = 0.02
    while True:
        generated = await counter(client)
        assert (await client.post("/admin/resume")).status_code == 200
        await asyncio.sleep(burst)
        await freeze(client)
        await asyncio.sleep(0.05)  # the last steps' outputs reach the counter and the client
        if await done():
            return
        if await counter(client) == generated:  # the engine did nothing in it: a longer burst
            assert burst < 30, "nothing was generated while the engine ran"
            burst *= 2
            continue
        settle = time.monotonic() + 1.0  # it did: the condition may still be on its way to the client
        while time.monotonic() < settle:
            await asyncio.sleep(0.05)
            if await done():
                return
