"""Weight updates under attack and mishap (issue 59): a continue or resume never steps the engine mid-swap, a push
whose commit outlives the client's timeout is reported as what the server finally serves, and a level-2 sleep
never serves discarded weights under the old label.

The real-server tests run on conftest's `held_server`, whose weight loads a test can hold at a point
(``SAMROLLOUT_TEST_HOLD_DIR``, `samrollout.server.weights.load_holds`): a flag file held there stands for a slow
disk or a slow load, without racing anything against a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from conftest import WEIGHT_LOAD_HOLDS
from samrollout.server.engine.runtime import DISCARDED_VERSION, ServerRuntime
from samrollout.server.errors import ApiError
from samrollout.testing import ServerProcess
from samrollout_client import AsyncRolloutClient
from samrollout_client.errors import RequestRejected, SamrolloutError
from support.frozen_engine import counter, frozen, step_until, until

HELD_AT = "weight load held at {point}"  # what the server logs once a load waits at a hold


@pytest.fixture(scope="module")
def holds() -> Path:
    """The folder whose flag files hold `held_server`'s weight loads (conftest's `WEIGHT_LOAD_HOLDS`)."""
    return WEIGHT_LOAD_HOLDS


@contextlib.contextmanager
def holding(holds: Path, point: str) -> Iterator[Path]:
    """Hold every weight load at ``point`` until the block ends (or the flag file it yields is deleted)."""
    flag = holds / f"hold-{point}"
    flag.touch()
    try:
        yield flag
    finally:
        flag.unlink(missing_ok=True)


def times_held(server: ServerProcess, point: str) -> int:
    """How often the server's log says a load waited at ``point``."""
    return server.log.read_text(errors="replace").count(HELD_AT.format(point=point))


async def held_from(server: ServerProcess, point: str, before: int) -> None:
    """Wait until a load waits at ``point`` (more than ``before`` times in the log)."""
    async def held() -> bool:
        return times_held(server, point) > before

    await until(held, f"a weight load held at {point}")


def status(server: ServerProcess) -> dict[str, Any]:
    """The held server's /admin/status (no key)."""
    reply = httpx.get(f"{server.url}/admin/status", params={"drafter": "false"}, timeout=60)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


LONG = {"model": "tiny", "prompt": "one two three four five", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}


@pytest.mark.parametrize("route", ["/admin/resume", "/areal_continue_generation"])
def test_a_resume_or_continue_sent_during_a_weight_swap_runs_no_engine_step_until_the_swap_ends(
        held_server: ServerProcess, holds: Path, tiny_dir: Path, route: str) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=held_server.url, timeout=300) as client:
            async with frozen(client):
                running = asyncio.create_task(client.post("/v1/completions", json=LONG))
                start = await counter(client)

                async def generating() -> bool:
                    return await counter(client) > start

                await step_until(client, generating)
                before = times_held(held_server, "swap")
                with holding(holds, "swap") as flag:
                    load = asyncio.create_task(client.post("/admin/update_weights", json={
                        "path": str(tiny_dir), "version": f"held-{route.strip('/')}", "in_flight": "continue-keep-kv"}))
                    await held_from(held_server, "swap", before)
                    swapping = await counter(client)
                    resumed = asyncio.create_task(client.post(route))
                    for _ in range(40):  # 2 s: an engine let run generates many tokens of the tiny model by then
                        await asyncio.sleep(0.05)
                        assert await counter(client) == swapping, f"{route} let the engine step during the swap"
                    flag.unlink()
                    assert (await load).status_code == 200
                assert (await resumed).status_code == 200
            reply = await running
            assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == LONG["max_tokens"]

    asyncio.run(scenario())
    assert status(held_server)["paused"] is False


def test_a_commit_outliving_its_clients_timeout_is_reported_as_what_the_server_finally_serves(
        held_server: ServerProcess, holds: Path, tiny_dir: Path) -> None:
    version = "pushed-past-the-timeout"
    request_timeout_s = 5.0

    async def scenario() -> Any:
        client = AsyncRolloutClient(held_server.url, "tiny", request_timeout_s=request_timeout_s)
        before = times_held(held_server, "check")
        with holding(holds, "check") as flag:
            push = asyncio.create_task(client.push_weights(tiny_dir, version, timeout_s=300))
            await held_from(held_server, "check", before)
            await asyncio.sleep(request_timeout_s + 3)  # the client's commit request has timed out by now
            flag.unlink()
            with contextlib.suppress(SamrolloutError):
                return await push
            return push.exception()

    outcome = asyncio.run(scenario())

    def committed() -> bool:
        return status(held_server)["weight_uploads"]["open"] == 0

    assert asyncio.run(_poll(committed)), "the commit never ended"
    served = status(held_server)["weight_version"]
    assert served == version, f"the server serves {served!r}"
    assert not isinstance(outcome, BaseException), f"the client reported {outcome!r} while the server loaded it"
    assert outcome.version == version


def test_a_commit_refused_after_its_clients_timeout_is_reported_refused_and_nothing_loads(
        held_server: ServerProcess, holds: Path, tiny_dir: Path) -> None:
    from safetensors.torch import load_file

    (weights,) = tiny_dir.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = float("inf")  # the value check refuses it, once the held check goes on
    served = status(held_server)["weight_version"]
    request_timeout_s = 5.0

    async def scenario() -> BaseException | None:
        client = AsyncRolloutClient(held_server.url, "tiny", request_timeout_s=request_timeout_s)
        before = times_held(held_server, "check")
        with holding(holds, "check") as flag:
            push = asyncio.create_task(client.push_weights(tensors, "never-loaded-late", timeout_s=300))
            await held_from(held_server, "check", before)
            await asyncio.sleep(request_timeout_s + 3)  # the client's commit request has timed out by now
            flag.unlink()
            with contextlib.suppress(SamrolloutError):
                await push
            return push.exception()

    refused = asyncio.run(scenario())
    assert isinstance(refused, RequestRejected) and refused.status == 400, repr(refused)
    assert "infinite" in refused.message
    assert status(held_server)["weight_version"] == served and status(held_server)["weight_uploads"]["open"] == 0


async def _poll(condition: Any, tries: int = 600) -> bool:
    for _ in range(tries):
        if condition():
            return True
        await asyncio.sleep(0.1)
    return False


def test_sleep_is_refused_with_a_clear_error_on_cpu_and_the_server_keeps_serving_its_weights(
        held_server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "seven eight nine", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{held_server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    version = status(held_server)["weight_version"]
    for path, kwargs in (("/admin/sleep", {"json": {"level": 2}}), ("/sleep", {"params": {"level": 2}}),
                         ("/admin/wake", {}), ("/wake_up", {})):
        reply = httpx.post(f"{held_server.url}{path}", timeout=60, **kwargs)
        assert reply.status_code == 409 and "sleep mode is off" in reply.json()["error"]["message"], reply.text
    now = status(held_server)
    assert (now["sleeping"], now["weight_version"]) == (False, version)
    again = httpx.post(f"{held_server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    assert again == first


# --- a level-2 sleep discards the weights: no generation until a load (any device; a stand-in engine here) ---

class SleepingEngine:
    """The engine calls sleep, wake and a load make, recorded (vLLM on CPU refuses sleep mode at start)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append("wake")
        return True

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.calls.append(method)
        return [None]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def sleeping_runtime(monkeypatch: pytest.MonkeyPatch) -> tuple[ServerRuntime, SleepingEngine]:
    """A runtime around `SleepingEngine` with sleep mode on; the weights check and vLLM's layout stubbed."""
    import sys

    from samrollout.server.engine import runtime as runtime_module

    async def pause_engine(engine: SleepingEngine, mode: str, clear_cache: bool) -> None:
        engine.calls.append("pause")

    async def set_engine_weight_version(engine: SleepingEngine, version: str) -> None:
        engine.calls.append(f"version {version}")

    async def checked(*args: Any, **kwargs: Any) -> Path:
        return Path("/weights")

    monkeypatch.setitem(sys.modules, "samrollout.server.vllm_compat.vllm_serving", SimpleNamespace(
        pause_engine=pause_engine, set_engine_weight_version=set_engine_weight_version))
    monkeypatch.setattr(runtime_module, "call_with_deadline", checked)
    engine = SleepingEngine()
    state = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)))
    settings = SimpleNamespace(weight_check_timeout=10.0, weight_value_check=False)
    runtime = ServerRuntime(settings=settings, engine=engine, generation=engine, state=state,  # type: ignore[arg-type]
                            model_name="tiny", vocab_size=10, max_model_len=64, weight_version="v1",
                            rollouts=None, weight_uploads=None, queue=None, weight_peers=None)  # type: ignore[arg-type]
    return runtime, engine


def test_after_a_level_2_sleep_and_a_wake_generation_is_refused_until_weights_are_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, engine = sleeping_runtime(monkeypatch)

    async def scenario() -> None:
        await runtime.sleep(2)
        await runtime.wake()
        with pytest.raises(ApiError) as refused:
            runtime.need_weights()
        assert refused.value.status == 503 and "load weights" in refused.value.message
        assert runtime.served_version == DISCARDED_VERSION
        await runtime.load_weights("/weights", "v2", "wait", param="path", source="test")
        runtime.need_weights()  # serving again
        assert runtime.served_version == "v2"

    asyncio.run(scenario())
    assert engine.calls[:2] == ["sleep 2", "wake"]


def test_a_level_1_sleep_keeps_the_weights_and_their_version(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, _ = sleeping_runtime(monkeypatch)

    async def scenario() -> None:
        await runtime.sleep(1)
        await runtime.wake()

    asyncio.run(scenario())
    runtime.need_weights()
    assert runtime.served_version == "v1"
