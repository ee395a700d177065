"""Weight updates with ``in_flight: "continue"`` on the real engine (the shared tiny server): requests in flight
go on under the new weights in the same response, nothing lost or generated twice, with exact version spans.

Each probe (completion, chat, ``n > 1``; streamed and not) runs alone and is frozen mid-generation:
it is sent to an engine frozen with ``/admin/pause`` mode "keep", which then runs a step at a time
(``/admin/step``: the engine counts the steps and freezes itself) until every choice has generated a token, and the
update with ``continue`` starts from there (it pauses the frozen engine again, preempts its requests, loads,
resumes), so where the update lands is fixed before it runs.  Every probe decodes greedily (the
argmax, sampled with ``top_k: 1``: see `TOP1`), so for each choice, with ``k`` the boundary its
spans give, the tokens before ``k`` are the old weights' greedy output and the tokens after are a
fresh greedy request's under the new weights, for the prompt plus the first ``k`` tokens, each
compared with the same request run alone (on this CPU the tiny random model's near-tied logits
flip with the batch's composition).

No timing assumption: the engine, not the test, counts the steps before the update lands.

``continue-keep-kv`` (the requests keep their KV cache) runs the same probes: with the same weights
under a new version a reply is the uninterrupted one token for token; with new weights the tokens
before the boundary are the old weights' and none is recomputed (what follows attends to the old
keys and values, so no fresh request is its reference); and a request after such an update reuses
no cache block the old weights computed.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess
from support.frozen_engine import (
    GENERATED,
    counter,
    freeze,
    in_flight_at_least,
    rollout_in_flight,
    step_until,
    until,
)
from support.weight_swap import WeightSwapper, swapping_weights

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Tokens of each probe: the update lands a step or two in (the engine is frozen until it does), so a short probe
# has room for both spans; every token is a seeded engine step, and the probes run one after the other.
LENGTH = 64
REUSE_LENGTH = 440  # the probe whose blocks a later request must not reuse: several full blocks, within the context


# --- the server: metrics, idleness, the weights it serves ---

def metric(server: ServerProcess, name: str) -> float:
    """The first /metrics sample named ``name`` (with its labels, if given; 0 when none is exported yet)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


ABORTED = 'samrollout_requests_finished_total{finish_reason="abort"}'
CONTINUED = 'samrollout_continued_requests_total{in_flight="continue"}'
KEPT_ON = 'samrollout_continued_requests_total{in_flight="continue-keep-kv"}'  # what the keep-KV mode carried on


def continued_by(in_flight: str) -> str:
    """The /metrics sample of the sequences updates of mode ``in_flight`` continued."""
    return f'samrollout_continued_requests_total{{in_flight="{in_flight}"}}'


RECOMPUTED = "samrollout_recomputed_tokens_total"


def wait_until_idle(server: ServerProcess, timeout: float = 120.0) -> None:
    """No request in the engine and none in flight over HTTP."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "vllm:num_requests_running") == 0 and admin_status(server)["in_flight_requests"] == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"the server is still busy after {timeout} s")


@pytest.fixture(scope="module")
def weights(tiny_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path) -> Iterator[WeightSwapper]:
    """The weight swapper; the original weights (under the version served before) are back at the end."""
    with swapping_weights(tiny_server, "continue", tiny_dir, tiny_weights_v2) as swapper:
        yield swapper


@pytest.fixture(autouse=True)
def serving_after(tiny_server: ServerProcess) -> Iterator[None]:
    """However a test here ends, the shared server is left resumed (the tests freeze it; the update resumes it)."""
    yield
    assert httpx.post(f"{tiny_server.url}/admin/resume", headers=AUTH, timeout=60).status_code == 200


async def update(client: httpx.AsyncClient, weights: WeightSwapper, version: str, in_flight: str = "continue",
                 *, same_weights: bool = False) -> dict[str, Any]:
    """``POST /admin/update_weights`` with ``in_flight``, loading the weights not served now (``same_weights``: the
    ones served now, under the new version)."""
    folder = weights.loaded if same_weights else weights.next_dir()
    reply = await client.post("/admin/update_weights",
                              json={"path": str(folder), "version": version, "in_flight": in_flight})
    assert reply.status_code == 200, reply.text
    weights.loaded = folder
    result: dict[str, Any] = reply.json()
    return result


def client_for(server: ServerProcess) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=600,
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


# --- requests and what came back ---

def completion(prompt: list[int], max_tokens: int = LENGTH, **extra: Any) -> dict[str, Any]:
    """A greedy completion of a token-id prompt that runs its full length."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": LENGTH,
            "ignore_eos": True, "temperature": 0, **extra}


def route_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@dataclass
class Choice:
    """One choice of a reply, streamed or not: its tokens, logprobs, finish reason and version spans."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    spans: list[dict[str, Any]] | None = None
    weight_version: str | None = None


@dataclass
class Reply:
    """A reply's prompt token ids and choices by index."""

    prompt_token_ids: list[int]
    choices: dict[int, Choice]


def _token_logprobs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return []
    if "token_logprobs" in logprobs:  # completions
        return [float(x) for x in logprobs["token_logprobs"]]
    return [float(entry["logprob"]) for entry in logprobs.get("content") or []]  # chat


def parse_body(body: dict[str, Any]) -> Reply:
    """A non-streamed reply."""
    prompt = body.get("prompt_token_ids") or body["choices"][0].get("prompt_token_ids")
    choices = {int(c["index"]): Choice(list(c["token_ids"]), _token_logprobs(c), c["finish_reason"],
                                       c["weight_version_spans"], c["weight_version"])
               for c in body["choices"]}
    return Reply(list(prompt), choices)


def parse_chunks(chunks: list[dict[str, Any]]) -> Reply:
    """A streamed reply: each choice's tokens and logprobs gathered over its chunks, its spans from its last."""
    prompt: list[int] = []
    choices: dict[int, Choice] = {}
    for chunk in chunks:
        prompt = prompt or list(chunk.get("prompt_token_ids") or [])
        for c in chunk.get("choices") or []:
            prompt = prompt or list(c.get("prompt_token_ids") or [])
            choice = choices.setdefault(int(c.get("index", 0)), Choice())
            choice.token_ids += c.get("token_ids") or []
            choice.logprobs += _token_logprobs(c)
            choice.weight_version = c.get("weight_version")
            if c.get("finish_reason") is not None:
                assert choice.finish_reason is None, "a choice ended twice"
                choice.finish_reason, choice.spans = c["finish_reason"], c.get("weight_version_spans")
            else:
                assert "weight_version_spans" not in c  # spans come once, on the chunk that ends the choice
    return Reply(prompt, choices)


async def post(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    reply = await client.post(route_of(body), json=body)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def stream(client: httpx.AsyncClient, body: dict[str, Any], generating: asyncio.Event | None = None,
                 hang_up: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """Every JSON chunk of a streamed reply; sets ``generating`` once every choice has a token; with ``hang_up``,
    closes the connection when it is set (after ``generating``)."""
    chunks: list[dict[str, Any]] = []
    seen: set[int] = set()
    async with client.stream("POST", route_of(body), json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            chunks.append(chunk)
            seen.update(int(c.get("index", 0)) for c in chunk.get("choices") or [] if c.get("token_ids"))
            if generating is not None and len(seen) == body.get("n", 1) and not generating.is_set():
                generating.set()
                if hang_up is not None:
                    await hang_up.wait()
                    return chunks  # leaving the block closes the connection
    return chunks


def span(start: int, end: int, version: str) -> dict[str, Any]:
    return {"start": start, "end": end, "version": version}


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3) for x, y in zip(a, b, strict=True))


# --- the scenarios ---

def prompt(number: int) -> list[int]:
    """A short token-id prompt of its own (ids well inside the vocabulary)."""
    return [1000 + 37 * number + j for j in range(8)]


# The argmax, as greedy sampling, but sampled as far as vLLM and the drafter know: vLLM refuses greedy n > 1, and
# seeded sampled requests get no drafts, so a lone probe makes one token per engine step (a greedy one drafts from
# its own loops and the history of its reference, and can run its whole length before the freeze lands).
TOP1 = {"temperature": 1.0, "top_k": 1}
PROBES = {  # each runs alone, so that it is computed as its references are (see `frozen_mid_generation`)
    "completion": completion(prompt(0), logprobs=2, seed=1, **TOP1),
    "chat": chat("continue me", seed=2, **TOP1),
    "completion n=3": completion(prompt(1), n=3, seed=3, **TOP1),
    "completion stream": {**completion(prompt(2), logprobs=1, seed=4, **TOP1), "stream": True},
    "chat stream": {**chat("continue me, streamed", seed=5, **TOP1), "stream": True},
    "completion n=2 stream": {**completion(prompt(3), n=2, seed=6, **TOP1), "stream": True},
}


async def frozen_mid_generation(client: httpx.AsyncClient, body: dict[str, Any]) -> asyncio.Task[Reply]:
    """Start ``body`` on a frozen engine and run it a step at a time until every choice has a token; frozen after.

    The engine is frozen (``/admin/pause`` "keep") before the request is sent, so the request
    waits in it; each ``/admin/step`` runs the engine one step and freezes it again, until the
    engine's token counter shows a token for every choice.  Where the update lands is then a few
    steps into the request, however slow this machine or its ``/metrics`` are (polling a running
    request raced it to its end on a loaded CI machine).  Each request runs alone because on this
    CPU the tiny random model's top logits are near-ties that flip with the batch's composition:
    only a request computed as its references are (alone, from the same prompt) can be compared
    with them token for token; pausing between steps does not change what a step computes.
    """
    n = int(body.get("n", 1))
    generated = await counter(client)
    await freeze(client)
    reply = asyncio.create_task(_streamed(client, body) if body.get("stream") else _posted(client, body))
    await until(lambda: in_flight_at_least(client, 1), "the request to arrive")

    async def every_choice_generated() -> bool:
        return await counter(client) >= generated + n

    await step_until(client, every_choice_generated)
    return reply


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    return parse_chunks(await stream(client, body))


async def _posted(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    return parse_body(await post(client, body))


def fresh_body(body: dict[str, Any], prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """``body``'s sampling as a fresh completion of the token-id prompt ``prompt_ids`` (not streamed)."""
    extra = {k: body[k] for k in ("n", "seed", "top_k", "temperature", "logprobs") if k in body}
    return completion(prompt_ids, max_tokens, **extra)


@pytest.mark.parametrize("kind", list(PROBES))
def test_continue_keeps_every_token_and_labels_each_with_the_weights_that_sampled_it(
        tiny_server: ServerProcess, weights: WeightSwapper, kind: str) -> None:
    wait_until_idle(tiny_server)
    body = PROBES[kind]
    n = int(body.get("n", 1))
    old, new = admin_status(tiny_server)["weight_version"], weights.new_version(kind.replace(" ", "-"))
    counted = {name: metric(tiny_server, name) for name in (CONTINUED, RECOMPUTED)}

    async def scenario() -> tuple[Reply, Reply, dict[str, Any], dict[int, Reply]]:
        async with client_for(tiny_server) as client:
            reference = parse_body(await post(client, {**body, "stream": False}))  # the old weights, alone
            running = await frozen_mid_generation(client, body)
            updated = await update(client, weights, new)
            reply = await running
            fresh: dict[int, Reply] = {}  # the new weights, alone, from the prompt + the tokens before the update
            for choice in reply.choices.values():
                k = choice.spans[0]["end"] if choice.spans and len(choice.spans) == 2 else None
                if k is not None and k not in fresh:
                    fresh[k] = parse_body(await post(client, fresh_body(
                        body, reply.prompt_token_ids + choice.token_ids[:k], LENGTH - k)))
            return reference, reply, updated, fresh

    reference, reply, updated, fresh = asyncio.run(scenario())
    assert sorted(reply.choices) == list(range(n)) and reply.prompt_token_ids == reference.prompt_token_ids
    recomputed = 0
    for index, choice in sorted(reply.choices.items()):
        # Nothing lost, nothing repeated: the full length, in two spans that cover it.
        assert choice.finish_reason == "length" and len(choice.token_ids) == LENGTH, (index, choice)
        assert choice.spans is not None and len(choice.spans) == 2, choice.spans
        k = choice.spans[0]["end"]
        assert 0 < k < LENGTH and choice.spans == [span(0, k, old), span(k, LENGTH, new)]
        assert choice.weight_version == old  # the label: its first token's version
        before, after = reference.choices[index], fresh[k].choices[index]
        assert choice.token_ids[:k] == before.token_ids[:k], f"choice {index}: not the old weights' tokens"
        assert choice.token_ids[k:] == after.token_ids, f"choice {index}: not the new weights' continuation"
        if body.get("logprobs"):  # each token's logprob is that of the weights that sampled it
            assert close(choice.logprobs[:k], before.logprobs[:k])
            assert close(choice.logprobs[k:], after.logprobs)
        recomputed += len(reply.prompt_token_ids) + k
    # The reply and the metrics count the sequences continued and the tokens prefilled again.
    assert updated["in_flight"] == "continue" and updated["previous_version"] == old
    assert (updated["continued_requests"], updated["recomputed_tokens"]) == (n, recomputed)
    assert metric(tiny_server, CONTINUED) - counted[CONTINUED] == n
    assert metric(tiny_server, RECOMPUTED) - counted[RECOMPUTED] == recomputed
    wait_until_idle(tiny_server)


def test_a_request_that_arrives_while_a_continue_update_holds_the_engine_runs_on_the_new_weights(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    wait_until_idle(tiny_server)
    new = weights.new_version("late")
    body = completion(prompt(4), 40, seed=9, **TOP1)

    async def scenario() -> tuple[Reply, dict[str, Any], Reply]:
        async with client_for(tiny_server) as client:
            await freeze(client)
            late = asyncio.create_task(_posted(client, body))
            await until(lambda: in_flight_at_least(client, 1), "the request to arrive")
            updated = await update(client, weights, new)
            reply = await late
            return reply, updated, parse_body(await post(client, body))

    reply, updated, again = asyncio.run(scenario())
    assert updated["continued_requests"] == 0  # it had not started: nothing to continue
    assert reply.choices[0].spans == [span(0, 40, new)] and reply.choices[0].weight_version == new
    assert reply.choices[0].token_ids == again.choices[0].token_ids


@pytest.mark.parametrize("in_flight", ["continue", "continue-keep-kv"])
def test_a_stream_whose_client_hangs_up_while_frozen_for_an_update_is_aborted_once_and_not_continued(
        tiny_server: ServerProcess, weights: WeightSwapper, in_flight: str) -> None:
    wait_until_idle(tiny_server)
    new = weights.new_version(f"hang-up-{in_flight}")
    rollout = f"{in_flight}-hung-up"
    body = completion(prompt(11), 480, rollout_id=rollout, seed=7, **TOP1)
    before = {name: metric(tiny_server, name) for name in (ABORTED, continued_by(in_flight))}

    async def scenario() -> tuple[dict[str, Any], float, dict[str, Any]]:
        async with client_for(tiny_server) as client:
            generating, hang_up = asyncio.Event(), asyncio.Event()
            await freeze(client)  # then step it until it streams a token: frozen long before its end
            reading = asyncio.create_task(stream(client, body, generating, hang_up))
            await until(lambda: in_flight_at_least(client, 1), "the stream to arrive")

            async def streaming() -> bool:
                return generating.is_set()

            await step_until(client, streaming)
            hang_up.set()
            await reading  # the connection is closed
            await until(lambda: _none_in_flight(client, rollout), "the hung-up stream to end")
            generated = metric(tiny_server, GENERATED)
            updated = await update(client, weights, new, in_flight)
            summary = (await client.get(f"/v1/rollouts/{rollout}")).json()
            return updated, generated, summary

    updated, generated, summary = asyncio.run(scenario())
    wait_until_idle(tiny_server)
    assert updated["continued_requests"] == 0 and updated["recomputed_tokens"] == 0  # gone before the update
    assert metric(tiny_server, GENERATED) == generated  # nothing ran after the update: it was not resumed
    assert summary["finish_reasons"] == {"abort": 1}
    assert metric(tiny_server, ABORTED) - before[ABORTED] == 1  # counted once
    assert metric(tiny_server, continued_by(in_flight)) == before[continued_by(in_flight)]


def test_a_stream_whose_client_hangs_up_as_a_continue_update_runs_is_aborted_once_wherever_it_lands(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    # The hang-up races the update: before its pause, while its requests wait preempted, or after the resume.
    # Wherever it lands, the request ends aborted (never run to its length) and is counted once.  The stream
    # starts on a frozen engine that runs a step at a time until it streams a token, so the race starts a few
    # tokens in (left running, it once reached its length before the hang-up on a loaded machine).
    wait_until_idle(tiny_server)
    new = weights.new_version("race")
    body = completion(prompt(12), 480, rollout_id="continue-race", seed=8, **TOP1)
    aborted_before = metric(tiny_server, ABORTED)

    async def scenario() -> dict[str, Any]:
        async with client_for(tiny_server) as client:
            generating, hang_up = asyncio.Event(), asyncio.Event()
            await freeze(client)  # the update resumes it
            reading = asyncio.create_task(stream(client, body, generating, hang_up))
            await until(lambda: in_flight_at_least(client, 1), "the stream to arrive")

            async def streaming() -> bool:
                return generating.is_set()

            await step_until(client, streaming)
            updating = asyncio.create_task(update(client, weights, new))
            hang_up.set()
            await reading
            await updating
            await until(lambda: _none_in_flight(client, "continue-race"), "the hung-up stream to end")
            summary: dict[str, Any] = (await client.get("/v1/rollouts/continue-race")).json()
            return summary

    summary = asyncio.run(scenario())
    wait_until_idle(tiny_server)
    assert summary["finish_reasons"] == {"abort": 1} and summary["output_tokens"] < 480
    assert metric(tiny_server, ABORTED) - aborted_before == 1


# --- "continue-keep-kv": the requests in flight keep their KV cache ---

KEEP = "continue-keep-kv"


def reply_spans_cover(choice: Choice, old: str, new: str) -> int:
    """The boundary ``k`` of a choice continued across one update: the full length, in two spans that cover it."""
    assert choice.finish_reason == "length" and len(choice.token_ids) == LENGTH, choice
    assert choice.spans is not None and len(choice.spans) == 2, choice.spans
    k = int(choice.spans[0]["end"])
    assert 0 < k < LENGTH and choice.spans == [span(0, k, old), span(k, LENGTH, new)]
    assert choice.weight_version == old  # the label: its first token's version
    return k


@dataclass
class KeepRun:
    """A probe run across a ``continue-keep-kv`` update: the versions, the reference, the reply, the counters."""

    n: int
    old: str
    new: str
    reference: Reply
    reply: Reply
    updated: dict[str, Any]
    counted: dict[str, float]  # KEPT_ON and RECOMPUTED before the update


def across_a_keep_kv_update(server: ServerProcess, weights: WeightSwapper, kind: str, *,
                            same_weights: bool = False) -> KeepRun:
    """Probe ``kind`` alone on the weights served (the reference), then again with a ``continue-keep-kv`` update
    to a new version (of the same weights, or the other ones) landing a few tokens in."""
    wait_until_idle(server)
    body = PROBES[kind]
    old = admin_status(server)["weight_version"]
    new = weights.new_version(f"{'same' if same_weights else 'keep'}-{kind.replace(' ', '-')}")
    counted = {name: metric(server, name) for name in (KEPT_ON, RECOMPUTED)}

    async def scenario() -> tuple[Reply, Reply, dict[str, Any]]:
        async with client_for(server) as client:
            reference = parse_body(await post(client, {**body, "stream": False}))
            running = await frozen_mid_generation(client, body)
            updated = await update(client, weights, new, KEEP, same_weights=same_weights)
            return reference, await running, updated

    reference, reply, updated = asyncio.run(scenario())
    assert sorted(reply.choices) == list(range(int(body.get("n", 1))))
    return KeepRun(int(body.get("n", 1)), old, new, reference, reply, updated, counted)


@pytest.mark.parametrize("kind", ["completion", "chat stream", "completion n=2 stream"])
def test_keep_kv_with_the_same_weights_gives_the_uninterrupted_output_and_recomputes_nothing(
        tiny_server: ServerProcess, weights: WeightSwapper, kind: str) -> None:
    # The same weights under a new version: keys and values kept are the ones the new weights would compute, so
    # the reply is the uninterrupted reply token for token (and logprob for logprob), in two labelled spans.
    run = across_a_keep_kv_update(tiny_server, weights, kind, same_weights=True)
    for index, choice in run.reply.choices.items():
        reply_spans_cover(choice, run.old, run.new)
        assert choice.token_ids == run.reference.choices[index].token_ids, f"choice {index} changed"
        if PROBES[kind].get("logprobs"):
            assert close(choice.logprobs, run.reference.choices[index].logprobs)
    assert run.updated["in_flight"] == KEEP
    assert (run.updated["continued_requests"], run.updated["recomputed_tokens"]) == (run.n, 0)
    last = admin_status(tiny_server)["last_weight_update"]  # the status shows the last update's cost
    assert last.pop("at") > 0 and last == run.updated
    assert metric(tiny_server, KEPT_ON) - run.counted[KEPT_ON] == run.n  # the keep-KV mode is counted, by mode
    assert metric(tiny_server, RECOMPUTED) == run.counted[RECOMPUTED]
    wait_until_idle(tiny_server)


@pytest.mark.parametrize("kind", ["completion n=3", "completion stream"])
def test_keep_kv_with_new_weights_keeps_the_old_tokens_and_goes_on_without_recomputing(
        tiny_server: ServerProcess, weights: WeightSwapper, kind: str) -> None:
    # What follows the boundary attends to keys and values the old weights wrote, so no fresh request is its
    # reference; before the boundary the tokens are the old weights' greedy output, and nothing is lost or repeated.
    run = across_a_keep_kv_update(tiny_server, weights, kind)
    for index, choice in run.reply.choices.items():
        k = reply_spans_cover(choice, run.old, run.new)
        before = run.reference.choices[index]
        assert choice.token_ids[:k] == before.token_ids[:k], f"choice {index}: not the old weights' tokens"
        if PROBES[kind].get("logprobs"):
            assert close(choice.logprobs[:k], before.logprobs[:k])
    assert (run.updated["continued_requests"], run.updated["recomputed_tokens"]) == (run.n, 0)
    assert metric(tiny_server, RECOMPUTED) == run.counted[RECOMPUTED]
    wait_until_idle(tiny_server)


PREEMPTED = "vllm:num_preemptions_total"  # vLLM's own count of preempted sequences
PREFILLED_AGAIN = "samrollout_engine_prefilled_again_tokens_total"  # the engine's re-admission lookups, not ours


@pytest.mark.parametrize("in_flight", [KEEP, "continue"])
def test_the_engines_counters_show_keep_kv_prefill_nothing_again_and_continue_prefill_the_whole_context(
        tiny_server: ServerProcess, weights: WeightSwapper, in_flight: str) -> None:
    """A stream frozen a few tokens in, updated to the same weights under a new version, counted by the engine
    itself: with ``continue-keep-kv`` nothing is preempted and no token prefilled again (and the reply is the
    uninterrupted one, token for token); with ``continue`` the sequence is preempted once and its prompt plus the
    tokens before the update are prefilled again.  (The update's own ``recomputed_tokens`` is the server's
    arithmetic, 0 by definition for keep-KV: these counters are what the engine did.)"""
    wait_until_idle(tiny_server)
    body = PROBES["completion stream"]
    old = admin_status(tiny_server)["weight_version"]
    new = weights.new_version(f"counters-{in_flight}")

    async def scenario() -> tuple[Reply, Reply, dict[str, float], dict[str, float]]:
        async with client_for(tiny_server) as client:
            reference = parse_body(await post(client, {**body, "stream": False}))
            running = await frozen_mid_generation(client, body)
            before = {name: await counter(client, name) for name in (PREEMPTED, PREFILLED_AGAIN)}
            await update(client, weights, new, in_flight, same_weights=True)
            reply = await running
            return reference, reply, before, {name: await counter(client, name) for name in before}

    reference, reply, before, after = asyncio.run(scenario())
    choice = reply.choices[0]
    k = reply_spans_cover(choice, old, new)
    preempted, prefilled = (after[name] - before[name] for name in (PREEMPTED, PREFILLED_AGAIN))
    if in_flight == KEEP:
        assert (preempted, prefilled) == (0, 0)
        assert choice.token_ids == reference.choices[0].token_ids
    else:
        assert (preempted, prefilled) == (1, len(reply.prompt_token_ids) + k)
    wait_until_idle(tiny_server)


def test_a_request_after_a_keep_kv_update_reuses_no_keys_or_values_of_the_old_weights(
        tiny_server: ServerProcess, weights: WeightSwapper) -> None:
    # A probe runs across a keep-KV update to its end; its blocks (prompt and tokens computed under the old
    # weights, and tokens after them attending to those) stay in the prefix cache.  A later request whose prompt
    # is the probe's prompt and output (several full blocks) must compute it all under the new weights: it gives
    # what the same request gives on an emptied cache.
    wait_until_idle(tiny_server)
    body = completion(prompt(13), REUSE_LENGTH, seed=10, **TOP1)
    new = weights.new_version("keep-reuse")

    async def scenario() -> tuple[dict[str, Any], Reply, Reply]:
        async with client_for(tiny_server) as client:
            generating = asyncio.Event()
            await freeze(client)
            reading = asyncio.create_task(stream(client, body, generating))
            await until(lambda: in_flight_at_least(client, 1), "the probe to arrive")

            async def streaming() -> bool:
                return generating.is_set()

            await step_until(client, streaming)
            updated = await update(client, weights, new, KEEP)  # resumes: the probe runs on under the new weights
            probe = parse_chunks(await reading)
            later = completion(probe.prompt_token_ids + probe.choices[0].token_ids[:300], 24, seed=11, **TOP1)
            after = parse_body(await post(client, later))
            assert (await client.post("/admin/reset_prefix_cache")).json() == {"reset": True}
            return updated, after, parse_body(await post(client, later))

    updated, after, fresh = asyncio.run(scenario())
    assert updated["continued_requests"] == 1 and updated["recomputed_tokens"] == 0
    assert after.choices[0].token_ids == fresh.choices[0].token_ids
    assert after.choices[0].spans == [span(0, 24, new)]
    wait_until_idle(tiny_server)


async def _none_in_flight(client: httpx.AsyncClient, rollout: str) -> bool:
    return await rollout_in_flight(client, rollout) == 0
