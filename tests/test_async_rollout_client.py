"""The client's side of asynchronous RL, against an in-process fake server (no engine): weight-version spans on
samples (plain and divided), partial rollouts (whole groups, carry-over, staleness restart and drop, aborted
samples, failures, the end of the prompts), the sync wrapper, and ``in_flight="continue"`` everywhere.

The fake speaks the few routes the client uses: /v1/completions generates one token per ``token_s`` and stamps
each token with the version served at that moment (what the real server's spans report after an update with
``in_flight: "continue"``); /admin/update_weights switches the version with wait / abort / continue semantics.
The last test runs a partial rollout on the real engine (the shared tiny server) across such an update; the
server's own exactness is tested in tests/test_weight_update_continue.py and test_weight_version_spans.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess
from samrollout_client import (
    AsyncRolloutClient,
    PartialRollout,
    RolloutClient,
    RolloutFailed,
    Sample,
    Sampling,
    WeightVersionSpan,
)
from samrollout_client.endpoints import Endpoint
from samrollout_client.rollouts.divided import DividedSample, move_target
from samrollout_client.spans import join_spans, parse_spans
from samrollout_client.verl.settings import backend_settings
from support.frozen_engine import counter, freeze, in_flight_at_least, step_until, until

URL = "http://fake:8000"


@dataclass(eq=False)
class _Running:
    rollout_id: str
    aborted: bool = False


@dataclass
class FakeServer:
    """Responses whose length the prompt names: ``"name:L0,L1,..."``: sample i (seed i) has L[i % len] tokens."""

    token_s: float = 0.002
    version: str = "v0"
    running: set[_Running] = field(default_factory=set)
    requests: int = 0
    holding: asyncio.Event | None = None  # set: new requests wait (a "wait" update in progress)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok", "weight_version": self.version})
        if path == "/v1/completions":
            return await self.complete(body)
        if path == "/admin/update_weights":
            return httpx.Response(200, json=await self.update(body["version"], body["in_flight"]))
        if path == "/admin/abort_rollout":
            hit = [r for r in self.running if r.rollout_id == body["rollout_id"]]
            for running in hit:
                running.aborted = True
            return httpx.Response(200, json={"aborted_requests": len(hit)})
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})

    async def complete(self, body: dict[str, Any]) -> httpx.Response:
        if self.holding is not None:
            await self.holding.wait()
        prompt = str(body["prompt"])
        if prompt.startswith("bad"):
            return httpx.Response(400, json={"error": {"message": "this prompt is refused"}})
        lengths = [int(x) for x in prompt.split(":", 1)[1].split(",")]
        length = min(lengths[int(body.get("seed") or 0) % len(lengths)], int(body["max_tokens"]))
        self.requests += 1
        running = _Running(str(body.get("rollout_id")))
        self.running.add(running)
        versions: list[str] = []
        try:
            while len(versions) < length and not running.aborted:
                await asyncio.sleep(self.token_s)
                versions.append(self.version)
        finally:
            self.running.discard(running)
        spans: list[dict[str, Any]] = []
        for index, version in enumerate(versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = index + 1
            else:
                spans.append({"start": index, "end": index + 1, "version": version})
        first = versions[0] if versions else self.version
        reason = "abort" if running.aborted else "length" if length == int(body["max_tokens"]) else "stop"
        choice = {"index": 0, "text": "x" * len(versions), "token_ids": list(range(len(versions))),
                  "finish_reason": reason, "weight_version": first, "weight_version_spans": spans}
        return httpx.Response(200, json={"choices": [choice], "weight_version": first})

    async def update(self, version: str, in_flight: str) -> dict[str, Any]:
        previous = self.version
        if in_flight == "wait":
            self.holding = asyncio.Event()
            while self.running:
                await asyncio.sleep(self.token_s)
        elif in_flight == "abort":
            for running in self.running:
                running.aborted = True
        self.version = version
        if self.holding is not None:
            self.holding.set()
            self.holding = None
        return {"weight_version": version, "previous_version": previous, "in_flight": in_flight}


def fake_client(server: FakeServer, **options: Any) -> AsyncRolloutClient:
    client = AsyncRolloutClient(URL, model="fake", **options)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    return client


SEEDED = Sampling(max_tokens=1024, seed=0)  # sample i is seeded i: its length is the prompt's i-th


@contextlib.asynccontextmanager
async def partial(server: FakeServer, work: Iterable[str],
                  **options: Any) -> AsyncIterator[tuple[AsyncRolloutClient, PartialRollout]]:
    async with fake_client(server) as client, client.partial_rollout(work, **options) as rollout:
        yield client, rollout


async def only_running(rollout: PartialRollout, count: int) -> None:
    """Until exactly ``count`` samples are generating (the others finished)."""
    for _ in range(1000):
        if rollout.running == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rollout.running} samples generating, not {count}")


def prompts(*lengths: str) -> list[str]:
    return [f"p{i}:{spec}" for i, spec in enumerate(lengths)]


# --- spans on samples -----------------------------------------------------------------------------


def test_sample_spans_versions_staleness_and_token_lags() -> None:
    sample = Sample(text="", token_ids=list(range(6)), endpoint=URL, weight_version="a",
                    weight_version_spans=[WeightVersionSpan(start=0, end=2, version="a"),
                                          WeightVersionSpan(start=2, end=5, version="b"),
                                          WeightVersionSpan(start=5, end=6, version="c")])
    assert sample.versions == ["a", "b", "c"]
    assert sample.token_versions() == ["a", "a", "b", "b", "b", "c"]
    assert sample.staleness(["a", "b", "c"]) == 2 and sample.staleness(["z", "a", "b", "c", "d"]) == 3
    assert sample.token_lags(["a", "b", "c"]) == [2, 2, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="not in the history"):
        sample.staleness(["b", "c"])
    empty = Sample(text="", token_ids=[], endpoint=URL)
    assert empty.versions == [] and empty.staleness(["a"]) == 0 and empty.token_lags([]) == []


def test_parse_spans_cuts_to_the_tokens_and_falls_back_to_the_label() -> None:
    raw = [{"start": 0, "end": 3, "version": "a"}, {"start": 3, "end": 9, "version": "b"}]
    assert [(s.start, s.end, s.version) for s in parse_spans(raw, 5, "a")] == [(0, 3, "a"), (3, 5, "b")]
    assert [(s.start, s.end, s.version) for s in parse_spans(None, 4, "a")] == [(0, 4, "a")]  # an older server
    assert parse_spans([], 0, "a") == [] and parse_spans(None, 0, "a") == []


def test_join_spans_shifts_each_piece_and_merges_neighbours() -> None:
    first = [WeightVersionSpan(start=0, end=4, version="a")]
    second = [WeightVersionSpan(start=0, end=2, version="a"), WeightVersionSpan(start=2, end=5, version="b")]
    joined = join_spans([(4, first), (5, second)])
    assert [(s.start, s.end, s.version) for s in joined] == [(0, 6, "a"), (6, 9, "b")]


def test_divided_sample_joins_its_pieces_spans() -> None:
    sample = DividedSample(max_tokens=20, want_logprobs=False)
    sample.start_piece("http://one")
    sample.see({"weight_version": "a", "choices": [{"index": 0, "text": "ab", "token_ids": [1, 2],
                                                    "prompt_token_ids": [9]}]})
    sample.see({"weight_version": "a", "choices": [{"index": 0, "text": "c", "token_ids": [3]}]})
    sample.start_piece("http://two")  # the first piece was abandoned: no final chunk, so no spans from the server
    sample.see({"weight_version": "a", "choices": [{"index": 0, "text": "de", "token_ids": [4, 5]}]})
    sample.see({"weight_version": "a", "choices": [{"index": 0, "text": "f", "token_ids": [6], "finish_reason":
                                                    "length", "weight_version_spans": [
                                                        {"start": 0, "end": 1, "version": "a"},
                                                        {"start": 1, "end": 3, "version": "b"}]}]})
    result = sample.to_sample("http://two", 1)
    assert [(s.start, s.end, s.version) for s in result.weight_version_spans] == [(0, 4, "a"), (4, 6, "b")]
    assert result.versions == ["a", "b"] and result.moves == 1
    assert [(s.start, s.end, s.version) for s in result.pieces[1].weight_version_spans] == [(0, 1, "a"),
                                                                                          (1, 3, "b")]


def test_a_divided_sample_moves_only_to_an_endpoint_known_to_serve_its_version() -> None:
    sample = DividedSample(max_tokens=100, want_logprobs=False)
    sample.start_piece("http://busy")
    sample.see({"weight_version": "v1", "choices": [{
        "index": 0, "text": "abcd", "token_ids": [1, 2, 3, 4], "prompt_token_ids": [9],
        "logprobs": {"token_logprobs": [-1.0] * 4, "tokens": ["a", "b", "c", "d"]}}]})
    busy = Endpoint("http://busy", outstanding=4, streaming=4, weight_version="v1")

    def target(version: str | None) -> Endpoint | None:
        return move_target(busy, [busy, Endpoint("http://idle", weight_version=version)], sample, 2)

    moved = target("v1")
    assert moved is not None and moved.url == "http://idle"
    assert target(None) is None  # not heard from yet: its version is unknown
    assert target("v2") is None  # another version than the sample's


def test_generate_reads_spans_and_records_versions() -> None:
    async def run() -> None:
        server = FakeServer()
        async with fake_client(server) as client:
            groups = await client.generate(prompts("5"), n=2, sampling=Sampling(max_tokens=16, seed=0))
            sample = groups[0].samples[0]
            assert [(s.start, s.end, s.version) for s in sample.weight_version_spans] == [(0, 5, "v0")]
            assert client.weight_versions == ["v0"]
            await client.update_weights("/ckpt", "v1", in_flight="continue")
            assert client.weight_versions == ["v0", "v1"]

    asyncio.run(run())


def test_in_flight_continue_is_accepted_by_the_verl_settings() -> None:
    config = {"custom": {"samrollout": {"urls": [URL], "in_flight": "continue"}}}
    assert backend_settings(config).in_flight == "continue"
    with pytest.raises(ValueError, match="'continue'"):
        backend_settings({"custom": {"samrollout": {"urls": [URL], "in_flight": "later"}}})


# --- partial rollouts -----------------------------------------------------------------------------


def test_a_step_returns_whole_groups_and_the_rest_continue_across_an_update() -> None:
    async def run() -> None:
        server = FakeServer()
        async with fake_client(server) as client:
            work = prompts("4", "400,4", "4", "4")  # group 1 has one long sample
            async with client.partial_rollout(work, group_size=2, batch_groups=2, max_concurrent_groups=3,
                                              sampling=SEEDED) as rollout:
                first = await rollout.next_batch()
                assert sorted(g.index for g in first) == [0, 2] and rollout.stats.carried_over == 1
                assert all(len(g.samples) == 2 for g in first) and rollout.held_groups == 2  # group 3 started
                await client.update_weights("/ckpt", "v1", in_flight="continue")
                second = await rollout.next_batch()
                assert sorted(g.index for g in second) == [1, 3]
                long = next(g for g in second if g.index == 1).samples[0]
                assert len(long.token_ids) == 400 and long.versions == ["v0", "v1"]
                assert long.weight_version_spans[0].start == 0 and long.weight_version_spans[-1].end == 400
                assert long.staleness(rollout.versions) == 1 and long.token_lags(rollout.versions)[-1] == 0
                assert await rollout.next_batch() == []
                stats = rollout.stats
                assert stats.groups_returned == 4 and stats.samples_returned == 8 and stats.batches == 2
                # group 1's long sample crossed the update; group 3's may have too, had it a token before it
                mixed = [s for g in (*first, *second) for s in g.samples if len(s.versions) > 1]
                assert stats.discarded_tokens == 0 and long in mixed and stats.mixed_version_samples == len(mixed)
                assert server.requests == 8  # nothing sent twice

    asyncio.run(run())


def test_async_for_ends_with_a_short_last_batch() -> None:
    async def run() -> None:
        async with fake_client(FakeServer()) as client:
            seen = []
            async with client.partial_rollout(iter(prompts("3", "3", "3")), group_size=2, batch_groups=2) as rollout:
                async for batch in rollout:
                    seen.append(sorted(g.index for g in batch))
            assert sorted(i for batch in seen for i in batch) == [0, 1, 2] and [len(b) for b in seen] == [2, 1]

    asyncio.run(run())


def test_a_sample_past_max_staleness_is_restarted_under_the_newest_weights() -> None:
    async def run() -> None:
        server = FakeServer()
        async with partial(server, prompts("4", "300,4"),
                           group_size=2, batch_groups=1, max_staleness=0, sampling=SEEDED) as (client, rollout):
            first = await rollout.next_batch()
            assert [g.index for g in first] == [0]
            await only_running(rollout, 1)  # the long sample's sibling finished under v0
            await client.update_weights("/ckpt", "v1", in_flight="continue")
            second = await rollout.next_batch()
            assert [g.index for g in second] == [1]
            assert all(s.versions == ["v1"] and s.staleness(rollout.versions) == 0 for s in second[0].samples)
            stats = rollout.stats
            # the short sibling was judged at the update (v0 only), the long one when it ended (v0 + v1)
            assert stats.restarted_stale == 2 and stats.discarded_tokens >= 4 + 1
            assert stats.max_staleness_returned == 0 and stats.groups_dropped == 0

    asyncio.run(run())


def test_on_stale_drop_gives_up_the_group_and_takes_the_next_prompt() -> None:
    async def run() -> None:
        server = FakeServer()
        async with partial(server, prompts("4", "600,4", "4", "4"), group_size=2, batch_groups=1, max_staleness=1,
                           on_stale="drop", sampling=SEEDED) as (client, rollout):
            assert [g.index for g in await rollout.next_batch()] == [0]  # then group 2 starts, under v0
            await only_running(rollout, 1)  # group 2 and the long sample's sibling finished under v0
            await client.update_weights("/ckpt", "v1", in_flight="continue")
            [group] = await rollout.next_batch()  # one version behind: within the bound
            assert group.index == 2 and group.staleness(rollout.versions) == 1
            await only_running(rollout, 1)  # group 3 finished under v1
            await client.update_weights("/ckpt", "v2", in_flight="continue")  # group 1's sibling: 2 behind
            assert [g.index for g in await rollout.next_batch()] == [3] and await rollout.next_batch() == []
            stats = rollout.stats
            assert stats.groups_dropped == 1 and stats.cancelled_requests == 1 and stats.discarded_tokens == 4
            assert stats.max_staleness_returned == 1 and server.requests == 8

    asyncio.run(run())


def test_samples_aborted_by_an_update_are_sent_again() -> None:
    async def run() -> None:
        server = FakeServer()
        async with partial(server, prompts("4", "200,4"),
                           group_size=2, batch_groups=1, sampling=SEEDED) as (client, rollout):
            await rollout.next_batch()
            await only_running(rollout, 1)
            await client.update_weights("/ckpt", "v1", in_flight="abort")
            [group] = await rollout.next_batch()
            assert group.index == 1 and all(s.finish_reason != "abort" for s in group.samples)
            assert group.samples[0].versions == ["v1"] and len(group.samples[0].token_ids) == 200
            assert rollout.stats.restarted_aborted == 1 and rollout.stats.discarded_tokens > 0

    asyncio.run(run())


def test_a_failed_sample_raises_once_and_the_rollout_goes_on() -> None:
    async def run() -> None:
        async with partial(FakeServer(), ["bad", "p:3", "p:3"], group_size=2, batch_groups=2) as (_, rollout):
            with pytest.raises(RolloutFailed, match="rejected") as failed:
                await rollout.next_batch()
            assert {f.group for f in failed.value.failures} == {0}
            assert sorted(g.index for g in await rollout.next_batch()) == [1, 2]
            assert rollout.stats.groups_failed == 1

    asyncio.run(run())


def test_next_batch_timeout_loses_nothing() -> None:
    async def run() -> None:
        async with partial(FakeServer(), prompts("150"),
                           group_size=1, batch_groups=1, sampling=Sampling(max_tokens=512)) as (_, rollout):
            with pytest.raises(TimeoutError):
                await rollout.next_batch(timeout_s=0.05)
            [group] = await rollout.next_batch()
            assert len(group.samples[0].token_ids) == 150

    asyncio.run(run())


def test_closing_cancels_what_is_in_flight() -> None:
    async def run() -> None:
        server = FakeServer()
        async with fake_client(server) as client:
            rollout = client.partial_rollout(prompts("1000", "1000"), group_size=2, batch_groups=1)
            await rollout.start()
            await asyncio.sleep(0.05)
            assert rollout.running == 4
            await rollout.aclose()
            await asyncio.sleep(0.01)
            assert rollout.stats.cancelled_requests == 4 and not server.running and rollout.running == 0
            with pytest.raises(RuntimeError, match="closed"):
                await rollout.next_batch()

    asyncio.run(run())


def test_a_partial_rollout_counts_its_groups_load_from_launch_and_uncounts_it_however_they_end() -> None:
    """Placement sees a group's samples on its endpoint as soon as the group starts (the next group placed in
    the same breath sees them), and nothing stays counted once the samples ended, ran or not."""
    async def run() -> list[int]:
        server = FakeServer()
        async with fake_client(server) as client:
            endpoint = client.pool.endpoints[0]
            rollout = client.partial_rollout(prompts("1000", "1000"), group_size=2, batch_groups=1)
            await rollout.start()  # both groups launched; no sample has run yet
            launched = endpoint.outstanding
            await rollout.aclose()  # cancelled before they ran
            closed = endpoint.outstanding
            async with client.partial_rollout(prompts("3", "3", "3"), group_size=2, batch_groups=1) as finished:
                async for _ in finished:
                    pass
            return [launched, closed, endpoint.outstanding]

    assert asyncio.run(run()) == [4, 0, 0]


def test_bad_arguments_are_refused() -> None:
    client = AsyncRolloutClient(URL, model="fake")
    with pytest.raises(ValueError, match="max_concurrent_groups"):
        client.partial_rollout([], batch_groups=4, max_concurrent_groups=2)
    with pytest.raises(ValueError, match="max_staleness"):
        client.partial_rollout([], batch_groups=1, max_staleness=-1)
    with pytest.raises(ValueError, match="on_stale"):
        client.partial_rollout([], batch_groups=1, on_stale="later")  # type: ignore[arg-type]

    async def too_many() -> None:
        async with fake_client(FakeServer()) as client:
            rollout = client.partial_rollout(prompts("3"), batch_groups=2)
            with pytest.raises(ValueError, match="max_concurrent_groups"):
                await rollout.next_batch(groups=5)
            await rollout.aclose()

    asyncio.run(too_many())


def test_the_sync_client_runs_a_partial_rollout_on_its_loop_thread() -> None:
    server = FakeServer()
    with RolloutClient(URL, model="fake") as client:
        async def mock() -> None:
            client._client._http = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))

        client._run(mock())
        with client.partial_rollout(prompts("3", "300", "3"), group_size=2, batch_groups=2,
                                    max_concurrent_groups=3) as rollout:
            first = rollout.next_batch()
            assert sorted(g.index for g in first) == [0, 2] and rollout.running == 2
            client.update_weights("/ckpt", "v1", in_flight="continue")
            [group] = rollout.next_batch()
            assert group.samples[0].versions == ["v0", "v1"] and rollout.versions == ["v0", "v1"]
            assert list(rollout) == [] and rollout.stats.groups_returned == 3


# --- on the real engine ---------------------------------------------------------------------------


def test_a_partial_rollout_carries_its_samples_across_a_continue_update_on_the_real_server(
        tiny_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path) -> None:
    """Six greedy samples frozen mid-generation (``/admin/pause`` keep), new weights with ``continue``: every
    sample ends at its full length in its first request, with spans over old then new weights."""
    length = 300
    sampling = Sampling(max_tokens=length, temperature=0, extra={"ignore_eos": True})
    start_version = admin_status(tiny_server)["weight_version"]

    async def run() -> None:
        async with (AsyncRolloutClient(tiny_server.url, model="tiny", api_key=API_KEY, max_in_flight=16) as client,
                    httpx.AsyncClient(base_url=tiny_server.url, timeout=60,
                                      headers={"Authorization": f"Bearer {API_KEY}"}) as admin):
            before = await counter(admin)
            await freeze(admin)  # the samples wait in the engine until it is stepped
            async with client.partial_rollout([f"carry {i}: one two three" for i in range(3)], group_size=2,
                                              batch_groups=1, max_concurrent_groups=3, sampling=sampling,
                                              rollout_id="client-carry") as rollout:
                await until(lambda: in_flight_at_least(admin, 3), "the samples to reach the server", timeout=120)

                async def started() -> bool:
                    return await counter(admin) >= before + 6

                # a few steps: the update lands before any sample ends, however slow this machine is
                await step_until(admin, started)
                old = client.weight_versions[-1]
                await client.update_weights(str(tiny_weights_v2), "client-carry-v2", in_flight="continue")
                await client.resume()
                groups = [g for _ in range(3) for g in await rollout.next_batch()]
                assert await rollout.next_batch() == []
                stats = rollout.stats
            assert sorted(g.index for g in groups) == [0, 1, 2] and rollout.versions[-2:] == [old, "client-carry-v2"]
            for sample in (s for g in groups for s in g.samples):
                assert len(sample.token_ids) == length and sample.finish_reason == "length"
                spans = sample.weight_version_spans
                assert spans[0].start == 0 and spans[-1].end == length
                assert all(a.end == b.start for a, b in itertools.pairwise(spans))
                assert sample.versions in ([old, "client-carry-v2"], ["client-carry-v2"])  # (one not started yet)
                assert sample.token_lags(rollout.versions)[-1] == 0
            assert stats.discarded_tokens == 0 and stats.restarted_aborted == 0 and stats.samples_returned == 6
            assert stats.mixed_version_samples >= 1 and stats.max_staleness_returned == 1

    try:
        asyncio.run(run())
    finally:
        reply = httpx.post(f"{tiny_server.url}/admin/update_weights", headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"path": str(tiny_dir), "version": start_version, "in_flight": "wait"}, timeout=300)
        assert reply.status_code == 200, reply.text
