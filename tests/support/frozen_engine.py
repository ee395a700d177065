"""Hold a server's engine still and run it a few steps at a time, so a test can act mid-generation.

On a loaded machine, a test that lets requests run and then reacts to what it sees from outside
(a metric, a status) can find them already finished. These helpers freeze the engine before the
requests arrive (``/admin/pause`` "keep" ends nothing; new requests wait in the engine), and then
run it a step at a time (``/admin/step``) until a condition holds, so what the test does next lands
a few steps in.  Pausing between steps does not change what a step computes.
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
    assert await _shows_within(condition, timeout), f"timed out waiting for {what}"


async def step(client: httpx.AsyncClient, steps: int = 1) -> int:
    """``/admin/step``: the frozen engine runs ``steps`` model steps and is frozen again; the steps it ran."""
    reply = await client.post("/admin/step", json={"steps": steps})
    assert reply.status_code == 200, reply.text
    return int(reply.json()["steps"])


async def step_until(client: httpx.AsyncClient, done: Callable[[], Awaitable[bool]], timeout: float = 180.0,
                     settle_s: float = 1.0) -> None:
    """Run the frozen engine one model step at a time until ``done()``; it is frozen after.

    The engine itself counts the steps (``/admin/step``), so however slow this machine, a request
    moves a step or so between checks (a burst timed from outside once ran a 440-token request to
    its end on a loaded CI machine).  After a step that generated tokens the condition has up to a
    second (``settle_s``) to show (a stream's chunk can reach its client late on a loaded machine); while the
    engine has nothing to run (the requests are still on their way to it), it is polled.  A test that only needs
    the engine not to run far ahead of its clients (a long request, a condition many steps away) settles less.
    """
    deadline = time.monotonic() + timeout
    while True:
        generated = await counter(client)
        ran = await step(client)
        if await done():
            return
        if ran and await counter(client) > generated and await _shows_within(done, settle_s):
            return
        assert time.monotonic() < deadline, "timed out stepping the engine"
        if not ran:
            await asyncio.sleep(0.05)


async def _shows_within(condition: Callable[[], Awaitable[bool]], seconds: float) -> bool:
    """Whether ``condition()`` is true now or turns true within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
