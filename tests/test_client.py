"""The trainer-side client against real servers: order, groups, retries, abort, weights, errors, install."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess, free_port
from samrollout_client import AsyncRolloutClient, GroupResult, RolloutClient, RolloutFailed, Sample, Sampling
from samrollout_client.placement import rendezvous_ranking
from samrollout_client.protocol.prompt_identity import prompt_id
from support.frozen_engine import frozen, in_flight_at_least, rollout_in_flight, step_until, until
from support.weight_swap import swapping_weights

CLIENTS = Path(__file__).resolve().parent.parent / "clients"


@pytest.fixture(scope="module")
def second_server(second_tiny_server: ServerProcess, tiny_dir: Path) -> Iterator[ServerProcess]:
    """The session's second tiny server, left on the weights and version it came with."""
    with swapping_weights(second_tiny_server, "client", tiny_dir, tiny_dir):
        yield second_tiny_server


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
            spans = [(span.start, span.end, span.version) for span in sample.weight_version_spans]
            assert spans == [(0, 12, sample.weight_version)]
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
            assert client.divide_after_tokens is None  # divided rollout is off by default: nothing moves
            groups = await client.generate([f"spread {i}" for i in range(8)], n=3,
                                           sampling=Sampling(max_tokens=24, temperature=0), rollout_id="spread")
            assert all(s.moves == 0 and s.pieces == [] for g in groups for s in g.samples)
            return [{s.endpoint for s in g.samples} for g in groups]

    endpoints = asyncio.run(run())
    assert all(len(e) == 1 for e in endpoints)  # a group's siblings share one server
    assert set().union(*endpoints) == {tiny_server.url, second_server.url}


def home_of(group: GroupResult) -> str:
    """The one endpoint all of a group's samples ran on."""
    endpoints = {s.endpoint for s in group.samples}
    assert len(endpoints) == 1, f"group {group.index} was split over {endpoints}"
    return endpoints.pop()


AFFINE_PROMPTS: list[str | list[int]] = [*(f"affine {i}: name a prime above {10 * i}" for i in range(8)),
                                         [1, 2, 3], [4, 5, 6, 7]]
SHORT = Sampling(max_tokens=8, temperature=0)


def test_affine_placement_keeps_each_prompt_on_one_server_every_step_and_for_a_new_client(
        tiny_server: ServerProcess, second_server: ServerProcess) -> None:
    """What lets each server find a prompt's earlier responses in its own history: the same server every step."""
    urls = [tiny_server.url, second_server.url]

    async def homes(client: AsyncRolloutClient, rollout_id: str) -> list[str]:
        groups = await client.generate(AFFINE_PROMPTS, n=2, sampling=SHORT, rollout_id=rollout_id)
        return [home_of(g) for g in groups]

    async def run() -> list[list[str]]:
        async with AsyncRolloutClient(urls, model="tiny", api_key=API_KEY, max_in_flight=32) as client:
            assert client.placement == "affine"  # the default
            steps = [await homes(client, "affine-1"), await homes(client, "affine-2")]
        async with AsyncRolloutClient(urls, model="tiny", api_key=API_KEY, max_in_flight=32) as fresh:
            steps.append(await homes(fresh, "affine-3"))
        return steps

    first, second, fresh = asyncio.run(run())
    assert first == second == fresh
    assert set(first) == set(urls)  # the load bound spreads the groups


def test_a_partial_rollout_runs_each_group_on_its_prompts_server(tiny_server: ServerProcess,
                                                                 second_server: ServerProcess) -> None:
    """One group at a time: nothing else loads the servers, so each goes to its prompt's first choice."""
    urls = [tiny_server.url, second_server.url]

    async def run() -> dict[int, str]:
        found: dict[int, str] = {}
        async with AsyncRolloutClient(urls, model="tiny", api_key=API_KEY) as client, \
                client.partial_rollout(AFFINE_PROMPTS, group_size=2, batch_groups=1, max_concurrent_groups=1,
                                       sampling=SHORT) as rollout:
            async for batch in rollout:
                found.update((g.index, home_of(g)) for g in batch)
        return found

    found = asyncio.run(run())
    assert found == {i: urls[rendezvous_ranking(prompt_id(p), urls)[0]] for i, p in enumerate(AFFINE_PROMPTS)}


class Relay:
    """A TCP relay on a fixed port to a real server: `close` refuses connections there and cuts those open (the
    server as the client sees it going down), `open` accepts them again (back up)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.url = f"http://127.0.0.1:{free_port()}"
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", int(self.url.rsplit(":", 1)[1]))

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        writers = [client_writer]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            writers.append(upstream_writer)
            pipes = [asyncio.create_task(HangUpProxy._pipe(client_reader, upstream_writer)),
                     asyncio.create_task(HangUpProxy._pipe(upstream_reader, client_writer))]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for writer in writers:
                writer.close()
            self._connections.discard(task)


def test_a_down_servers_prompts_go_to_the_next_server_and_come_back_after_it_recovers(
        tiny_server: ServerProcess, second_server: ServerProcess) -> None:
    async def run() -> tuple[list[str], list[GroupResult], list[str], str]:
        relay = Relay(second_server.url)
        await relay.open()
        async with AsyncRolloutClient([tiny_server.url, relay.url], model="tiny", api_key=API_KEY, max_in_flight=32,
                                      backoff_s=0.05) as client:
            up = [home_of(g) for g in await client.generate(AFFINE_PROMPTS, n=2, sampling=SHORT)]
            await relay.close()
            down = await client.generate(AFFINE_PROMPTS, n=2, sampling=SHORT)
            await relay.open()
            relayed = client.pool.by_url(relay.url)
            while relayed.down_until > time.monotonic():
                await asyncio.sleep(0.05)
            await client.generate(["a probe finds the server back"], n=1, sampling=SHORT)
            back = [home_of(g) for g in await client.generate(AFFINE_PROMPTS, n=2, sampling=SHORT)]
            await relay.close()
        return up, down, back, relay.url

    up, down, back, relay = asyncio.run(run())
    assert relay in up and tiny_server.url in up
    for home, group in zip(up, down, strict=True):
        assert home_of(group) == tiny_server.url and all(len(s.token_ids) == 8 for s in group.samples)
        assert all(s.attempts == (2 if home == relay else 1) for s in group.samples)  # failed over, or untouched
    assert back == up


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
        AsyncRolloutClient("http://127.0.0.1:1", model="m", placement="random")


def test_a_prompt_has_one_identity_in_the_client_and_the_server() -> None:
    import hashlib
    import struct

    import numpy as np

    from samrollout.server.engine.length_predictor import prompt_key
    from samrollout_client.placement import LengthHistory
    from samrollout_client.protocol.prompt_identity import prompt_id, token_bytes
    from samrollout_client.verl.sampling import group_key

    ids = [151644, 8948, 198, 0, 2**31 - 1, 2**32 - 1]
    # veRL's group ids are compared across processes (its router, the servers): spelled as they always were.
    assert group_key(ids) == hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in ids), digest_size=10).hexdigest()
    # Token prompts: one identity, from a list or a numpy array of any integer type, in the server and the client.
    assert prompt_key(ids, "fallback") == prompt_id(ids) == prompt_id(np.array(ids, dtype=np.int64))
    assert prompt_id(ids[:-2]) == prompt_id(np.array(ids[:-2], dtype=np.int32)) == prompt_id(tuple(ids[:-2]))
    assert prompt_id(np.arange(10, dtype=np.int32)[::2]) == prompt_id([0, 2, 4, 6, 8])  # a strided view
    assert prompt_id(ids) != prompt_id(ids[:-1]) and prompt_key([], "fallback") == "fallback"
    with pytest.raises(struct.error):
        prompt_id([-1])
    # Text is a domain of its own: the same bytes as a token prompt are another prompt.
    assert token_bytes([0x00636261]) == b"abc\x00" and prompt_id("abc\x00") != prompt_id([0x00636261])
    history = LengthHistory()
    history.record("the prompt", [10, 20])
    history.record([1, 2, 3], [40])
    assert history.predict("the prompt") == 15 and history.predict([1, 2, 3]) == 40 and history.predict("other") is None


def test_the_server_distribution_depends_on_this_client_at_its_version() -> None:
    """The server imports samrollout_client.protocol, so it declares the client, which installs with it."""
    import tomllib

    server = tomllib.loads((CLIENTS.parent / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((CLIENTS / "pyproject.toml").read_text())["project"]
    assert f"{client['name']}=={client['version']}" in server["dependencies"]


# --- divided rollout: a long sample continues on a less loaded endpoint -----------------------------------

DIVIDED_PROMPT = "def main():"  # the tiny model's greedy answer changes tokens at a few positions, not one loop
# How long `divided_group` lets each step's tokens reach the client before the next step: a late chunk only merges
# a few steps' tokens, and a 200-token response leaves room for a move long after the first 16.
SETTLE_S = 0.3


def long_greedy(max_tokens: int = 200, logprobs: int | None = 0) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=0, logprobs=logprobs, extra={"ignore_eos": True})


async def alone(urls: list[str], prompt: str | list[int], n: int, sampling: Sampling) -> list[Sample]:
    """The samples of one group generated without divided rollout (the reference)."""
    async with AsyncRolloutClient(urls, model="tiny", api_key=API_KEY) as plain:
        return (await plain.generate([prompt], n=n, sampling=sampling))[0].samples


async def divided_group(first: ServerProcess, second: ServerProcess, sampling: Sampling,
                        rollout_id: str) -> list[Sample]:
    """The samples of one group of 2 on ``first`` with divided rollout (``divide_after_tokens=16``), its engine run a
    step at a time until one sample has moved to ``second``; then everything runs freely to its end.

    A sample moves only at the end of a streamed chunk, and only before its last token.  Left to run, the tiny
    model makes 4 tokens a step in a few milliseconds; on a loaded machine the server's stream can fall behind the
    engine and send a whole response in two chunks (its first token, then the other 199): no chunk ends where a
    move may happen, and the sample stays (the earlier failure: 0 moves).  Stepped, each chunk holds a step's
    tokens, or a few steps' when one reaches the client later than `SETTLE_S`, however slow the machine
    (`support.frozen_engine`).  ``least-outstanding``
    placement, so that the group starts on ``first`` whatever the servers' ports (affine placement would pick by
    a hash of the URLs); the moved piece reaches ``second``, which runs freely.
    """
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with AsyncRolloutClient([first.url, second.url], model="tiny", api_key=API_KEY, divide_after_tokens=16,
                                  placement="least-outstanding") as client, \
            httpx.AsyncClient(base_url=first.url, headers=auth, timeout=120) as held, \
            httpx.AsyncClient(base_url=second.url, headers=auth, timeout=120) as target:

        async def moved() -> bool:
            return (await target.get(f"/v1/rollouts/{rollout_id}")).status_code == 200  # it has seen the rollout

        async with frozen(held):
            running = asyncio.create_task(client.generate([DIVIDED_PROMPT], n=2, sampling=sampling,
                                                          rollout_id=rollout_id))
            await until(lambda: in_flight_at_least(held, 2), "both samples to reach the first server")
            await step_until(held, moved, settle_s=SETTLE_S)
        groups = await running
        assert [(e.outstanding, e.streaming) for e in client.pool.endpoints] == [(0, 0), (0, 0)]
    return groups[0].samples


def test_a_greedy_sample_moved_mid_response_equals_the_unmoved_sample(tiny_server: ServerProcess,
                                                                     second_server: ServerProcess) -> None:
    """Two siblings start on the first server (2 outstanding against 0): one moves once, and both are the same."""
    urls = [tiny_server.url, second_server.url]

    async def run() -> tuple[list[Sample], list[Sample]]:
        reference = await alone(urls, DIVIDED_PROMPT, 1, long_greedy())
        return reference, await divided_group(tiny_server, second_server, long_greedy(), "divided-greedy")

    reference, samples = asyncio.run(run())
    moved, stayed = sorted(samples, key=lambda s: -s.moves)
    assert (moved.moves, stayed.moves) == (1, 0) and stayed.pieces == []
    assert [p.endpoint for p in moved.pieces] == urls and moved.endpoint == second_server.url
    assert moved.pieces[0].tokens >= 16 and sum(p.tokens for p in moved.pieces) == 200
    assert {p.weight_version for p in moved.pieces} == {moved.weight_version}
    # the pieces' spans joined: one version, so one span over all the tokens
    assert [(s.start, s.end, s.version) for s in moved.weight_version_spans] == [(0, 200, moved.weight_version)]
    for sample in (moved, stayed):
        assert sample.token_ids == reference[0].token_ids and sample.text == reference[0].text
        assert sample.prompt_token_ids == reference[0].prompt_token_ids and sample.finish_reason == "length"
        assert sample.logprobs is not None and reference[0].logprobs is not None
        assert sample.logprobs == pytest.approx(reference[0].logprobs, abs=1e-3)


def test_a_moved_seeded_sample_is_whole_and_keeps_its_first_piece(tiny_server: ServerProcess,
                                                                  second_server: ServerProcess,
                                                                  tiny_dir: Path) -> None:
    """Sampled: the first piece is the seed's own draw; after the cut, fresh draws (another seed); all parts whole."""
    from tokenizers import Tokenizer

    urls = [tiny_server.url, second_server.url]
    sampling = Sampling(max_tokens=120, temperature=1.0, seed=5, extra={"ignore_eos": True})

    async def run() -> tuple[list[Sample], list[Sample]]:
        reference = await alone(urls, DIVIDED_PROMPT, 2, sampling)
        return reference, await divided_group(tiny_server, second_server, sampling, "divided-seeded")

    reference, samples = asyncio.run(run())
    assert sorted(s.moves for s in samples) == [0, 1]
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    for sample, alone_sample in zip(samples, reference, strict=True):
        assert len(sample.token_ids) == 120 and sample.logprobs is None and sample.finish_reason == "length"
        assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        if sample.moves == 0:
            assert sample.token_ids == alone_sample.token_ids
        else:
            cut = sample.pieces[0].tokens
            assert sample.token_ids[:cut] == alone_sample.token_ids[:cut]
            assert sample.token_ids[cut:] != alone_sample.token_ids[cut:]  # drawn with a seed of its own


def test_a_sample_whose_server_fails_mid_response_continues_elsewhere_from_its_tokens(
        tiny_server: ServerProcess, second_server: ServerProcess) -> None:
    """The connection to the first server breaks after two streamed chunks: the rest comes from the second
    (``least-outstanding`` placement: the sample starts on the first server)."""

    async def run() -> tuple[list[Sample], Sample, str]:
        reference = await alone([tiny_server.url], DIVIDED_PROMPT, 1, long_greedy(logprobs=None))
        async with HangUpProxy(tiny_server.url, events=2) as proxy, AsyncRolloutClient(
                [proxy.url, second_server.url], model="tiny", api_key=API_KEY, divide_after_tokens=10_000,
                backoff_s=0.1, placement="least-outstanding") as client:
            groups = await client.generate([DIVIDED_PROMPT], n=1, sampling=long_greedy(logprobs=None))
            assert proxy.hung_up
            return reference, groups[0].samples[0], proxy.url

    reference, sample, proxy_url = asyncio.run(run())
    assert sample.token_ids == reference[0].token_ids and sample.text == reference[0].text
    assert sample.moves == 1 and sample.attempts == 2 and sample.logprobs is None
    assert [p.endpoint for p in sample.pieces] == [proxy_url, second_server.url] and sample.pieces[0].tokens > 0


def test_a_continuation_the_target_refuses_restarts_the_sample_unmoved(tiny_server: ServerProcess,
                                                                      second_server: ServerProcess) -> None:
    """`tiny_server` caps prompts at 480 tokens: a 470-token prompt plus 12 generated ones is refused there.

    The group starts on `second_server` (first in the list, ``least-outstanding`` placement), whose engine is run a
    step at a time until the continuation has been refused (`divided_group` says why a free-running engine can send
    the whole response in two chunks, leaving no chunk end where a move may happen); then everything runs freely.
    """
    prompt = [1000] * 470
    auth = {"Authorization": f"Bearer {API_KEY}"}
    refused_before = refused_requests(tiny_server)

    async def refused(capped: httpx.AsyncClient) -> bool:
        return refused_in((await capped.get("/metrics")).text) > refused_before

    async def run() -> list[Sample]:
        async with AsyncRolloutClient([second_server.url, tiny_server.url], model="tiny", api_key=API_KEY,
                                      divide_after_tokens=12, placement="least-outstanding") as client, \
                httpx.AsyncClient(base_url=second_server.url, headers=auth, timeout=120) as held, \
                httpx.AsyncClient(base_url=tiny_server.url, headers=auth, timeout=120) as capped:
            async with frozen(held):
                running = asyncio.create_task(client.generate([prompt], n=2, sampling=long_greedy(max_tokens=40)))
                await until(lambda: in_flight_at_least(held, 2), "both samples to reach the uncapped server")
                await step_until(held, lambda: refused(capped))
            groups = await running
        return groups[0].samples

    samples = asyncio.run(run())
    assert refused_requests(tiny_server) == refused_before + 1  # the continuation
    assert all(s.moves == 0 and s.pieces == [] and len(s.token_ids) == 40 for s in samples)
    assert samples[0].token_ids == samples[1].token_ids


def refused_requests(server: ServerProcess) -> float:
    """The server's count of 400 answers (``samrollout_http_errors_total{code="400"}``)."""
    return refused_in(httpx.get(f"{server.url}/metrics", timeout=30).text)


def refused_in(metrics: str) -> float:
    """The count of 400 answers in a /metrics page."""
    for line in metrics.splitlines():
        if line.startswith("samrollout_http_errors_total{") and 'code="400"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_divided_rollout_settings_are_checked_before_any_request() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="divide_after_tokens must be None"):
            AsyncRolloutClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], model="m",
                               divide_after_tokens=bad)
    with RolloutClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], model="m", divide_after_tokens=8) as client:
        with pytest.raises(ValueError, match="stop strings"):
            client.generate(["x"], sampling=Sampling(stop=["\n"]))
        with pytest.raises(ValueError, match="'presence_penalty'"):
            client.generate(["x"], sampling=Sampling(extra={"presence_penalty": 0.5}))


class HangUpProxy:
    """A TCP proxy to ``upstream`` that hangs up the first streamed response after ``events`` SSE events.

    The client sees what a server dying mid-response looks like (a connection closed inside
    the body); the server sees a client that hung up. Later connections pass through.
    """

    def __init__(self, upstream: str, events: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.events, self.hung_up = (host, int(port)), events, False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> HangUpProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        await asyncio.wait_for(asyncio.gather(*self._connections, return_exceptions=True), 30)

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        pipes = [asyncio.create_task(self._pipe(client_reader, upstream_writer)),
                 asyncio.create_task(self._down(upstream_reader, client_writer))]
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)  # either side closed, or the hang-up
        for pipe in pipes:
            pipe.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        for writer in (client_writer, upstream_writer):
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        history, sent = b"", 0
        while data := await reader.read(65536):
            history += data
            cut = None if self.hung_up else _end_of_events(history, self.events)
            writer.write(history[sent:cut])
            await writer.drain()
            sent = len(history)
            if cut is not None:
                self.hung_up = True
                return


def _end_of_events(data: bytes, count: int) -> int | None:
    """The offset just past the ``count``-th complete ``data: {...}`` SSE event in ``data``, or None."""
    position = 0
    for _ in range(count):
        start = data.find(b"data: {", position)
        end = data.find(b"\n\n", start) if start >= 0 else -1
        if end < 0:
            return None
        position = end + 2
    return position


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


def test_a_server_killed_mid_rollout_has_its_samples_retried_elsewhere(tiny_server: ServerProcess,
                                                                       tiny_server_to_kill: ServerProcess) -> None:
    doomed = tiny_server_to_kill
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
    """Until ``count`` requests of ``rollout_id`` are in flight (a loaded machine's API process once took over a
    minute to take eight: `until`'s 180 s)."""
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:

        async def arrived() -> bool:
            return await rollout_in_flight(http, rollout_id) >= count

        await until(arrived, f"{count} requests of {rollout_id} to reach the server")


def test_weight_update_is_visible_in_the_returned_version(tiny_server: ServerProcess, second_server: ServerProcess,
                                                          tiny_dir: Path) -> None:
    with swapping_weights(tiny_server, "client", tiny_dir, tiny_dir), \
            RolloutClient([tiny_server.url, second_server.url], model="tiny", api_key=API_KEY) as client:
        client.update_weights(str(tiny_dir), "client-v7")  # both servers; each gets its version back after
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


def test_generate_takes_sampling_as_a_dict_as_openai_users_write_it(client: RolloutClient) -> None:
    prompts = ["What is 21 * 8?", "What is 3 + 4?"]
    as_dict = client.generate(prompts, n=4, sampling={"max_tokens": 9, "temperature": 0}, rollout_id="client-dict")
    as_model = client.generate(prompts, n=4, sampling=Sampling(max_tokens=9, temperature=0))
    assert [[s.token_ids for s in g.samples] for g in as_dict] == [[s.token_ids for s in g.samples] for g in as_model]
    assert all(len(s.token_ids) == 9 for g in as_dict for s in g.samples)
    sampled = client.generate(prompts, n=4, sampling={"max_tokens": 6, "temperature": 1.0, "stop": "zzz"})
    assert all(len(s.token_ids) <= 6 for g in sampled for s in g.samples)


def test_wrong_public_arguments_fail_at_the_call_naming_what_to_pass(client: RolloutClient,
                                                                     tiny_server: ServerProcess) -> None:
    with pytest.raises(ValueError, match=r"Sampling has no field 'max_token'; its fields are max_tokens"):
        client.generate(["x"], n=2, sampling={"max_token": 48})
    with pytest.raises(ValueError, match=r"pass the group size as generate\(n=...\)"):
        client.generate(["x"], n=2, sampling={"max_tokens": 4, "n": 2})
    with pytest.raises(ValueError, match="bad Sampling field: temperature"):
        client.generate(["x"], n=2, sampling={"temperature": -1})
    with pytest.raises(TypeError, match=r"sampling must be a samrollout_client\.Sampling or a dict"):
        client.generate(["x"], n=2, sampling=48)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass \[prompt\] for one"):
        client.generate("What is 2 + 2?", n=2)
    with pytest.raises(TypeError, match="n must be an int"):
        client.generate(["x"], n="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass \[prompt\] for one"):
        client.partial_rollout("What is 2 + 2?", 2, batch_groups=1)
    with pytest.raises(ValueError, match="Sampling has no field 'maxTokens'"):
        client.partial_rollout(["x"], 2, batch_groups=1, sampling={"maxTokens": 4})
    with pytest.raises(ValueError, match=r"in_flight must be one of \('wait', 'abort', 'continue'"):
        client.update_weights("/nowhere", "v9", in_flight="keep")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="version must be a non-empty string"):
        client.push_weights({}, version=3)  # type: ignore[arg-type]
    assert admin_status(tiny_server)["in_flight_requests"] == 0  # none of them sent anything


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
