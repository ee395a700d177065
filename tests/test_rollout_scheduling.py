"""Length-aware rollout scheduling: exact tokens, probes first then the longest groups, aborts, history, metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import API_KEY, TINY_CONTEXT, TINY_SERVER_MEMORY, server_fixture
from samrollout.server.engine.admission import AdmissionScheduler
from samrollout.server.engine.length_predictor import LengthPredictor, prompt_key
from samrollout.spec_decode.stats import ProposerStats
from samrollout.testing import ServerProcess
from support.frozen_engine import counter, frozen, step_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAPACITY = 4  # the length-aware server's --max-num-seqs (the server admits one more): most test traffic queues


def length_aware_server_args(tiny_dir: Path) -> list[str]:
    """The tiny server's settings plus --rollout-scheduling length-aware and only CAPACITY engine slots."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY,
            "--max-model-len", str(TINY_CONTEXT), "--max-n", "16", "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY), "--threshold-mode", "static",
            "--rollout-scheduling", "length-aware", "--max-num-seqs", str(CAPACITY)]


length_aware_server = server_fixture("length_aware_server", length_aware_server_args)


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json() for reply in replies]


def _choices(replies: list[dict[str, Any]]) -> list[list[tuple[list[int], list[float] | None]]]:
    return [[(c["token_ids"], (c.get("logprobs") or {}).get("token_logprobs")) for c in r["choices"]]
            for r in replies]


async def _until_waiting(client: httpx.AsyncClient, at_least: int, timeout: float = 120.0,
                         running: int = 0) -> dict[str, Any]:
    """Poll /admin/status until ``at_least`` sequences wait for admission (and at least ``running`` are
    admitted: arrivals are counted as waiting before the first admissions); the scheduling status then."""
    deadline = asyncio.get_running_loop().time() + timeout
    seen: list[tuple[int, int]] = []  # (running, waiting) each time it changed, for the failure message
    while asyncio.get_running_loop().time() < deadline:
        # without the drafter's counters: their round trip to the busy worker can take seconds
        scheduling: dict[str, Any] = (await client.get("/admin/status?drafter=false")).json()["scheduling"]
        if scheduling["waiting"] >= at_least and scheduling["running"] >= running:
            return scheduling
        if not seen or seen[-1] != (scheduling["running"], scheduling["waiting"]):
            seen.append((scheduling["running"], scheduling["waiting"]))
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {at_least} sequences ever waited (with {running} running) within {timeout} s; "
                         f"(running, waiting) seen: {seen[:50]}")


def _status(server: ServerProcess) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{server.url}/admin/status", headers=AUTH, timeout=60).json()
    return result


def test_length_aware_scheduling_returns_the_same_tokens_and_logprobs_as_fcfs(
        tiny_server: ServerProcess, length_aware_server: ServerProcess) -> None:
    """Seeded requests sent at once (most of them queue: n = 4 fanned out, groups of n = 1), and greedy ones.

    Greedy requests go one at a time: the tiny random model's top logits are near-ties that
    flip with the batch's composition on this CPU even between two fcfs runs of one server,
    so greedy tokens are compared at equal batch composition.
    """
    seeded: list[dict[str, Any]] = []
    for g in range(6):
        prompt = [11 + g, 7, 3, 11 + g, 7]
        sampling = {"temperature": 1.0, "top_p": 0.9, "logprobs": 1, "ignore_eos": True}
        seeded.append({"model": "tiny", "prompt": prompt, "n": 4, "max_tokens": 12 + 6 * g, "seed": 100 + g,
                       **sampling})
        seeded += [{"model": "tiny", "prompt": prompt, "max_tokens": 10 + 8 * g, "seed": 200 + 10 * g + i,
                    "group_id": f"same-tokens-{g}", **sampling} for i in range(3)]
    greedy = [{"model": "tiny", "prompt": [21 + g, 4, 21 + g], "max_tokens": 16, "temperature": 0.0, "logprobs": 1,
               "group_id": f"greedy-{g % 2}"} for g in range(4)]

    def run(server: ServerProcess) -> list[list[tuple[list[int], list[float] | None]]]:
        together = asyncio.run(_post_all(server.url, seeded))
        one_by_one = [reply for body in greedy for reply in asyncio.run(_post_all(server.url, [body]))]
        return _choices(together + one_by_one)

    for fcfs_choices, la_choices in zip(run(tiny_server), run(length_aware_server), strict=True):
        assert [ids for ids, _ in la_choices] == [ids for ids, _ in fcfs_choices]
        for (_, la_logprobs), (_, fcfs_logprobs) in zip(la_choices, fcfs_choices, strict=True):
            assert la_logprobs == pytest.approx(fcfs_logprobs, abs=1e-4)


def test_n_children_fanned_out_by_the_server_match_vllms_own_n(length_aware_server: ServerProcess) -> None:
    """A seeded n = 3 request equals three n = 1 requests with seeds seed, seed+1, seed+2 (vLLM's rule)."""
    base = {"model": "tiny", "prompt": [5, 9, 2], "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    together, *alone = asyncio.run(_post_all(length_aware_server.url, [
        {**base, "n": 3, "seed": 42}, *({**base, "seed": 42 + i} for i in range(3))]))
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in together["choices"]] == [r["choices"][0]["token_ids"] for r in alone]


def test_streamed_n_request_delivers_every_child_once_under_length_aware(length_aware_server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": [8, 8, 8], "n": 3, "max_tokens": 6, "ignore_eos": True, "stream": True}
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished: dict[int, str] = {}
    with httpx.stream("POST", f"{length_aware_server.url}/v1/completions", json=body, headers=AUTH,
                      timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens[choice["index"]] += choice.get("token_ids") or []
                    if choice.get("finish_reason"):
                        finished[choice["index"]] = choice["finish_reason"]
    assert {i: len(t) for i, t in tokens.items()} == {0: 6, 1: 6, 2: 6}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_aborting_a_rollout_ends_its_waiting_sequences_and_the_server_keeps_serving(
        length_aware_server: ServerProcess) -> None:
    rollout = "la-abort"
    # Sampled (on CPU only greedy requests draft), 480 tokens each, sixteen times the slots: the queue
    # drains five at a time, so it holds a dozen or more for many seconds (no race with a short window;
    # with eight times the slots, a full suite's load once stalled the polls until the queue had drained).
    bodies = [{"model": "tiny", "prompt": [3, g, 5], "max_tokens": 480, "ignore_eos": True, "rollout_id": rollout,
               "group_id": f"abort-{g}", "temperature": 1.0, "seed": g} for g in range(16 * CAPACITY)]

    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=length_aware_server.url, headers=AUTH, timeout=300) as client:
            capacity = (await client.get("/admin/status?drafter=false")).json()["scheduling"]["capacity"]
            posts = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            try:
                await _until_waiting(client, 3 * CAPACITY, running=capacity)
            except AssertionError as error:
                ended = [(p.result().status_code, p.result().text[:300]) for p in posts if p.done()]
                raise AssertionError(f"{error}; replies so far: {ended}") from None
            # frozen while the queue is read and the rollout aborted: no slot frees, so nothing is admitted
            assert (await client.post("/admin/pause", json={"mode": "keep"})).status_code == 200
            queued = (await client.get("/admin/status?drafter=false")).json()["scheduling"]
            aborted = await client.post("/admin/abort_rollout", json={"rollout_id": rollout})
            assert aborted.status_code == 200
            # resumed before the replies are read: an engine add that the pause held runs after it
            assert (await client.post("/admin/resume")).status_code == 200
            replies = [(await p).json() for p in posts]
            return replies, queued

    replies, queued = asyncio.run(scenario())
    assert queued["running"] == queued["capacity"] == CAPACITY + 1  # the engine's slots and one of headroom
    assert queued["waiting"] >= 1  # (the queue drains while the pause call itself waits on the busy engine)
    outcomes = [(r["choices"][0]["finish_reason"], len(r["choices"][0]["token_ids"])) for r in replies]
    # Every sequence still waiting at the abort ends unadmitted: finish "abort", no tokens.
    assert sum(1 for outcome in outcomes if outcome == ("abort", 0)) >= queued["waiting"]
    # The rest ended by themselves before the pause, or were aborted in the engine (or, an add the
    # pause held, ran after the resume): none is lost.
    assert all(reason == "abort" or (reason, n) == ("length", 480) for reason, n in outcomes)
    after = _status(length_aware_server)["scheduling"]
    assert (after["running"], after["waiting"]) == (0, 0)
    again = asyncio.run(_post_all(length_aware_server.url, [{"model": "tiny", "prompt": [1, 2], "max_tokens": 4}]))
    assert len(again[0]["choices"][0]["token_ids"]) == 4


def test_scheduling_policy_wait_and_prediction_error_are_exported(length_aware_server: ServerProcess) -> None:
    asyncio.run(_post_all(length_aware_server.url, [
        {"model": "tiny", "prompt": [9, 9, g], "max_tokens": 8, "ignore_eos": True, "group_id": f"metrics-{g % 3}"}
        for g in range(12)]))
    text = httpx.get(f"{length_aware_server.url}/metrics", timeout=30).text
    assert 'samrollout_rollout_scheduling_info{policy="length-aware"} 1.0' in text
    counts = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("samrollout_") and "_count" in line}
    assert counts["samrollout_scheduler_wait_seconds_count"] >= 12
    assert counts["samrollout_scheduler_length_prediction_error_ratio_count"] >= 1
    assert counts["samrollout_engine_queue_seconds_count"] >= 12
    assert _status(length_aware_server)["scheduling"]["policy"] == "length-aware"


# --- the admission order itself (the real scheduler; lengths given directly) ---

def _scheduler(capacity: int, progress: dict[str, int], history: int = 16) -> AdmissionScheduler:
    return AdmissionScheduler(capacity, LengthPredictor(history), lambda child: progress.get(child, 0))


def test_each_groups_first_sequence_runs_before_any_sibling() -> None:
    async def order() -> list[str]:
        scheduler = _scheduler(1, {})
        blocker = scheduler.enqueue("blocker", "blocker", "blocker", "blocker")
        entries = [scheduler.enqueue(f"{g}.{i}", f"{g}.{i}", g, g) for g in "abc" for i in range(3)]
        scheduler.done(blocker, None)
        admitted = [e.child_id for e in entries if e.admitted.done()]
        while scheduler.waiting or scheduler.running:
            scheduler.done(scheduler.running[next(iter(scheduler.running))], 10)
            admitted += [e.child_id for e in entries if e.admitted.done() and e.child_id not in admitted]
        return admitted
    admitted = asyncio.run(order())
    assert admitted[:3] == ["a.0", "b.0", "c.0"]


def test_siblings_of_the_group_whose_probe_runs_longest_go_first() -> None:
    async def next_admitted() -> str:
        progress = {"short.0": 5, "long.0": 90, "mid.0": 40}
        scheduler = _scheduler(3, progress)
        probes = [scheduler.enqueue(f"{g}.0", f"{g}.0", g, g) for g in ("short", "long", "mid")]
        siblings = [scheduler.enqueue(f"{g}.{i}", f"{g}.{i}", g, g) for g in ("short", "mid", "long")
                    for i in (1, 2)]
        assert all(p.admitted.done() for p in probes) and not any(s.admitted.done() for s in siblings)
        scheduler.done(probes[0], 5)  # the short group's probe finished: one slot
        return next(s.child_id for s in siblings if s.admitted.done())
    assert asyncio.run(next_admitted()) == "long.1"


def test_lengths_from_an_earlier_rollout_order_the_next_one_and_the_history_is_bounded() -> None:
    async def second_epoch() -> tuple[list[str], int]:
        scheduler = _scheduler(1, {}, history=3)
        lengths = {"p0": 10, "p1": 300, "p2": 20, "p3": 50}
        for prompt, length in lengths.items():  # epoch 1: one sequence per prompt, run to its length
            entry = scheduler.enqueue(f"e1.{prompt}", f"e1.{prompt}", f"e1.{prompt}", prompt)
            await entry.admitted
            scheduler.done(entry, length)
        blocker = scheduler.enqueue("blocker", "blocker", "blocker", "other")
        epoch2 = [scheduler.enqueue(f"e2.{p}", f"e2.{p}", f"e2.{p}", p) for p in lengths]
        order = []
        scheduler.done(blocker, None)  # aborted sequences teach nothing: the history stays as epoch 1 left it
        while scheduler.running:
            entry = next(iter(scheduler.running.values()))
            order.append(entry.child_id)
            scheduler.done(entry, None)
        assert all(e.admitted.done() for e in epoch2)
        return order, scheduler.predictor.history_size()
    order, remembered = asyncio.run(second_epoch())
    # p0 fell out of the 3-prompt history: it is a probe again and runs first; then longest first.
    assert order == ["e2.p0", "e2.p1", "e2.p3", "e2.p2"]
    assert remembered == 3


def test_prompt_keys_depend_on_the_tokens_only() -> None:
    assert prompt_key([1, 2, 3], "x") == prompt_key([1, 2, 3], "y") != prompt_key([1, 2, 4], "x")
    assert prompt_key(None, "fallback") == "fallback"


def test_weight_update_with_sequences_waiting_for_admission_loses_none_of_them(
        length_aware_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path) -> None:
    """in_flight=wait: every sequence, admitted or still waiting in the server, finishes; then abort ends the rest."""
    # Sampled (on CPU only greedy requests draft): the second round's requests, whose prompts the first
    # round's responses are history for, still take their 64 engine steps.  They reach a frozen engine, so
    # four times the slots stay queued however slow the status polls are on a busy machine; the engine then
    # runs a step at a time until the admitted ones have started, and each update lands on that state.
    bodies = [{"model": "tiny", "prompt": [4, g, 4], "max_tokens": 64, "ignore_eos": True, "group_id": f"w-{g % 3}",
               "temperature": 1.0, "seed": g} for g in range(4 * CAPACITY)]

    async def update_while(in_flight: str, path: Path, version: str) -> tuple[list[dict[str, Any]], int]:
        async with httpx.AsyncClient(base_url=length_aware_server.url, headers=AUTH, timeout=300) as client:
            generated = await counter(client)
            async with frozen(client):
                posts = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
                await _until_waiting(client, len(bodies) - CAPACITY - 1, running=CAPACITY + 1)

                async def started() -> bool:
                    return await counter(client) >= generated + CAPACITY + 1

                await step_until(client, started)
                update = await client.post("/admin/update_weights",
                                           json={"path": str(path), "version": version, "in_flight": in_flight})
            return [(await p).json() for p in posts], update.status_code

    waited, code = asyncio.run(update_while("wait", tiny_weights_v2, "v2"))
    assert code == 200
    assert [r["choices"][0]["finish_reason"] for r in waited] == ["length"] * len(bodies)
    assert {r["weight_version"] for r in waited} == {"initial", "v2"}  # the admitted ones on the old weights
    aborted, code = asyncio.run(update_while("abort", tiny_dir, "v3"))
    assert code == 200
    assert [r["choices"][0]["finish_reason"] for r in aborted] == ["abort"] * len(bodies)  # running and waiting
    after = _status(length_aware_server)
    assert after["weight_version"] == "v3"
    assert (after["scheduling"]["running"], after["scheduling"]["waiting"]) == (0, 0)


def test_status_for_polling_leaves_out_the_drafter_counters(length_aware_server: ServerProcess) -> None:
    """``?drafter=false``: the queue and the server's own state, without the round trip to the engine's worker."""
    reply = httpx.get(f"{length_aware_server.url}/admin/status?drafter=false", headers=AUTH, timeout=60)
    assert reply.status_code == 200
    body = reply.json()
    assert body["drafter"] is None
    assert body["scheduling"]["policy"] == "length-aware" and body["scheduling"]["capacity"] == CAPACITY + 1
    assert ProposerStats.from_json(_status(length_aware_server)["drafter"]).k >= 1  # the default still has them
