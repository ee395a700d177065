"""The asynchronous client: rollouts over one or more samrollout servers, weight sync, admin calls.

    async with AsyncRolloutClient(["http://127.0.0.1:8000"], model="smollm2-135m-instruct") as client:
        groups = await client.generate(prompts, n=8, sampling=Sampling(max_tokens=512), rollout_id="step-3")

Each prompt becomes a group of ``n`` requests (one sample each) carrying one ``group_id``
and the ``rollout_id``, sent to one endpoint so the server drafts across the siblings
(which endpoint: ``placement``, see `samrollout_client.placement`; by default ``affine``:
the same endpoint for a prompt every step, within a load bound, so that its server finds
the prompt's earlier responses); at most ``max_in_flight`` requests are outstanding.  A
request that fails with a connection error, a timeout or a 5xx is retried on another
endpoint with backoff (under ``affine``, the next of its prompt's ranking); a 4xx
is not retried, except 429 (the server's queue is full): the request waits for the
server's ``Retry-After`` (with backoff and jitter) and is sent again, up to
``max_busy_retries`` times, without counting as a failed attempt.  Results come back in
input order; if anything is still missing after the retries (or the overall timeout),
`RolloutFailed` names each missing sample and carries the partial results.

With ``divide_after_tokens`` (off by default) and several endpoints, samples are streamed
and a long one can continue on a less loaded endpoint from what it has generated
(`samrollout_client.rollouts.divided`).

For asynchronous RL, `AsyncRolloutClient.partial_rollout` returns batches of whole groups as
they complete and carries the unfinished samples into the next step, across weight updates
with ``in_flight="continue"`` (`samrollout_client.rollouts.partial`).  Every sample carries its
weight-version spans (`samrollout_client.spans`); `AsyncRolloutClient.weight_versions` orders
the versions this client saw served.

This module is the generation; the client's other parts have modules of their own: HTTP and what
its failures mean (`samrollout_client.transport`), the versions seen served
(`samrollout_client.weight_sync.versions`) and the all-or-nothing weight push
(`samrollout_client.weight_sync.weight_push`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import httpx

from samrollout_client.arguments import (
    SamplingLike,
    as_sampling,
    check_count,
    check_optional_text,
    check_prompts,
    check_update,
)
from samrollout_client.endpoints import Endpoint, EndpointPool
from samrollout_client.errors import NoEndpointAvailable, RequestRejected, RolloutFailed, SamrolloutError
from samrollout_client.placement import DEFAULT_PLACEMENT, GroupDemand, LengthHistory, Placement, placement_policy
from samrollout_client.protocol.modes import InFlight, PauseMode
from samrollout_client.protocol.prompt_identity import prompt_id
from samrollout_client.rollout_rules import DEFAULT_MAX_STALENESS
from samrollout_client.rollouts.divided import (
    DividedSample,
    StreamError,
    check_divide_after_tokens,
    check_divisible,
    stream_piece,
)
from samrollout_client.rollouts.partial import PartialRollout
from samrollout_client.rollouts.progress import RolloutProgress
from samrollout_client.rollouts.report import combine_summaries
from samrollout_client.spans import parse_spans
from samrollout_client.transport import RETRYABLE_ERRORS, Busy, Retryable, Transport, check_status
from samrollout_client.types import (
    GroupResult,
    Prompt,
    RolloutReport,
    Sample,
    SampleFailure,
    Sampling,
    SpecStats,
    StalePolicy,
    WeightPush,
)
from samrollout_client.weight_sync.versions import VersionTracker
from samrollout_client.weight_sync.weight_commit import WeightsSplit, commit_weights, push_weights, roll_back
from samrollout_client.weight_sync.weight_files import DEFAULT_SHARD_BYTES, WeightFiles, WeightsSource
from samrollout_client.weight_sync.weight_push import StagedWeights, stage_weights


class AsyncRolloutClient:
    """Rollouts against samrollout servers (use as ``async with``; see the module docstring).

    ``placement``: which endpoint a prompt's group goes to (`samrollout_client.placement`):
    ``"affine"`` (the default) keeps a prompt on one endpoint across steps, within 1.25x of its
    share of the requests in flight, so each server sees its prompts' earlier responses;
    ``"least-outstanding"`` and ``"predicted-work"`` balance load alone.

    ``divide_after_tokens``: None (the default) leaves every sample on the endpoint it
    started on.  An integer C >= 1 turns divided rollout on (with more than one endpoint):
    every sample is streamed, and one whose current piece has C tokens or more can continue
    from its generated tokens on an endpoint with room for it (the rule, the exactness notes
    and the refused sampling settings: `samrollout_client.rollouts.divided`).
    """

    def __init__(self, endpoints: str | Sequence[str], model: str, *, api_key: str | None = None,
                 max_in_flight: int = 64, max_attempts: int = 4, request_timeout_s: float = 600.0,
                 backoff_s: float = 0.5, progress: bool = False,
                 placement: Placement = DEFAULT_PLACEMENT, divide_after_tokens: int | None = None,
                 max_busy_retries: int = 120) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if max_in_flight < 1 or max_attempts < 1:
            raise ValueError("max_in_flight and max_attempts must be at least 1")
        self.policy = placement_policy(placement)  # ValueError for a name not in PLACEMENTS
        check_divide_after_tokens(divide_after_tokens)
        self.placement, self.divide_after_tokens = placement, divide_after_tokens
        self.history = LengthHistory()  # response lengths per prompt, from this client's earlier rollouts
        self.pool = EndpointPool(urls, min_backoff_s=backoff_s)
        self.model, self.max_in_flight, self.max_attempts = model, max_in_flight, max_attempts
        self.backoff_s, self.progress, self.max_busy_retries = backoff_s, progress, max_busy_retries
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_in_flight + 8, max_keepalive_connections=max_in_flight + 8)
        self._transport = Transport(httpx.AsyncClient(headers=headers, timeout=request_timeout_s, limits=limits),
                                    self.pool, backoff_s=backoff_s, max_busy_retries=max_busy_retries)
        self._versions = VersionTracker(self._transport)  # open partial rollouts listen to it

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    @property
    def weight_versions(self) -> list[str]:
        """Weight versions in the order this client saw them served, newest last: the versions its endpoints
        reported (/health, responses' spans) and each version its `update_weights` / `push_weights` loaded."""
        return self._versions.versions

    @property
    def _http(self) -> httpx.AsyncClient:
        """The HTTP client every call goes through (replaceable, e.g. by one on a mock transport)."""
        return self._transport.http

    @_http.setter
    def _http(self, http: httpx.AsyncClient) -> None:
        self._transport.http = http

    # --- rollouts -------------------------------------------------------------------------------

    async def generate(self, prompts: Sequence[Prompt], n: int = 8, sampling: SamplingLike = None,
                       rollout_id: str | None = None, timeout_s: float | None = None) -> list[GroupResult]:
        """``n`` samples for every prompt, in input order (see the module docstring for retries and errors).

        ``sampling``: a `Sampling` or a dict of its fields (``{"max_tokens": 48, "temperature": 1.0}``);
        a wrong argument raises TypeError or ValueError here, before any request."""
        check_count("n", n)
        check_prompts(prompts)
        check_optional_text("rollout_id", rollout_id)
        sampling = as_sampling(sampling)
        if not prompts:
            return []
        if self.divide_after_tokens is not None:
            check_divisible(sampling)
        rollout_id = rollout_id or f"rollout-{uuid.uuid4().hex[:12]}"
        groups = [GroupResult(index=i, prompt=p, group_id=f"{rollout_id}.g{i}", samples=[])
                  for i, p in enumerate(prompts)]
        slots: list[list[Sample | None]] = [[None] * n for _ in prompts]
        failures: list[SampleFailure] = []
        gate = asyncio.Semaphore(self.max_in_flight)
        bar = RolloutProgress(len(prompts) * n, enabled=self.progress, description=rollout_id)

        planned = self._plan(prompts, n)
        if self.divide_after_tokens is not None and len(self.pool.endpoints) > 1:
            await self._versions.refresh()  # a sample moves only to an endpoint known to serve its version

        async def run_group(group: GroupResult) -> None:
            # siblings go together, so they share the server's group automaton
            home = planned[group.index] if planned and not planned[group.index].down \
                else await self._choose(prompt=group.prompt, work=n)
            home.outstanding += n  # reserved now, so the next group's choice sees this one
            await asyncio.gather(*(run_sample(group, i, home) for i in range(n)))

        async def run_sample(group: GroupResult, index: int, home: Endpoint) -> None:
            async with gate:
                bar.started()
                try:
                    slots[group.index][index] = await self._sample(group, index, sampling, rollout_id, home)
                    bar.finished(slots[group.index][index])
                except SamrolloutError as error:
                    failures.append(SampleFailure(group=group.index, sample=index, error=str(error)))
                    bar.finished(None)

        tasks = [asyncio.create_task(run_group(g)) for g in groups]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.abort(rollout_id)
            failures += [SampleFailure(group=g, sample=s, error=f"not finished within {timeout_s} s")
                         for g, row in enumerate(slots) for s, sample in enumerate(row) if sample is None
                         and not any(f.group == g and f.sample == s for f in failures)]
        finally:
            bar.close()
        return self._settled(rollout_id, groups, slots, failures)

    def _settled(self, rollout_id: str, groups: list[GroupResult], slots: list[list[Sample | None]],
                 failures: list[SampleFailure]) -> list[GroupResult]:
        """A rollout's groups with their samples, their lengths remembered for placement; RolloutFailed (carrying
        them) if any sample is missing."""
        for group in groups:
            group.samples = [s for s in slots[group.index] if s is not None]
            self.history.record(group.prompt, [len(s.token_ids) for s in group.samples if s.finish_reason != "abort"])
        if failures:
            failures.sort(key=lambda f: (f.group, f.sample))
            raise RolloutFailed(f"rollout {rollout_id} is incomplete", failures, groups)
        return groups

    def partial_rollout(self, prompts: Iterable[Prompt], group_size: int = 8, *, batch_groups: int,
                        sampling: SamplingLike = None,
                        max_staleness: int | None = DEFAULT_MAX_STALENESS,
                        on_stale: StalePolicy = "restart", max_concurrent_groups: int | None = None,
                        rollout_id: str | None = None) -> PartialRollout:
        """Batches of ``batch_groups`` whole groups of ``group_size`` samples; unfinished ones run into the next step.

        For asynchronous RL (`samrollout_client.rollouts.partial`): up to ``max_concurrent_groups``
        groups (default ``2 * batch_groups``) generate at once, a new prompt is taken from
        ``prompts`` (any iterable, also endless; ``group.index`` is a prompt's position in it)
        whenever a group is returned or given up, and `PartialRollout.next_batch` returns the
        first ``batch_groups`` groups to complete, the stalest first.  Push new weights with
        ``in_flight="continue"`` so the samples still generating go on under them.
        ``max_staleness`` (default 2, `rollout_rules.DEFAULT_MAX_STALENESS`; None: no bound) is the most
        versions a returned sample's oldest token may lag behind the newest (`Sample.staleness`); a
        finished sample past it is sent again from its prompt (``on_stale="restart"``) or its group
        is given up (``"drop"``).  Use as ``async with client.partial_rollout(...) as rollout:``.
        """
        return PartialRollout(_ClientSampler(self), prompts, group_size=group_size, batch_groups=batch_groups,
                              sampling=sampling, max_staleness=max_staleness, on_stale=on_stale,
                              max_concurrent_groups=max_concurrent_groups, rollout_id=rollout_id)

    def _plan(self, prompts: Sequence[Prompt], n: int) -> list[Endpoint] | None:
        """Each group's endpoint when the placement places the batch as a whole (`PlacementPolicy.plan`: under
        ``affine`` and ``predicted-work``, weighed by the lengths remembered); None: each is chosen as it starts,
        also with fewer than two endpoints up (the choice then probes those down)."""
        up = [e for e in self.pool.endpoints if not e.down]
        if len(up) < 2:
            return None
        groups = [GroupDemand(prompt_id(prompt), n, self.history.predict(prompt)) for prompt in prompts]
        planned = self.policy.plan(groups, [e.url for e in up], [e.outstanding for e in up])
        return None if planned is None else [up[i] for i in planned]

    async def _choose(self, avoid: set[str] | None = None, prompt: Prompt | None = None, work: int = 1) -> Endpoint:
        """The up endpoint for ``work`` requests of ``prompt`` under this client's placement, probing and
        waiting for down endpoints as `EndpointPool.choose` does (``avoid``: endpoints already tried)."""
        return await self.pool.choose(self._http, lambda up: self._pick(up, prompt, work), avoid)

    def _place(self, prompt: Prompt, work: int, in_flight: int | None = None) -> Endpoint | None:
        """The endpoint for ``work`` requests of ``prompt`` among those up now (None: none is up); no probing.
        ``in_flight``: the requests the caller will keep in flight (a partial rollout's), which the load bound
        shares out even while fewer have started."""
        up = [e for e in self.pool.endpoints if not e.down]
        return self._pick(up, prompt, work, in_flight) if up else None

    def _pick(self, candidates: list[Endpoint], prompt: Prompt | None, work: int,
              in_flight: int | None = None) -> Endpoint:
        """Of ``candidates`` (up, never empty), the one this client's placement picks (`PlacementPolicy.pick`) by
        their outstanding requests: under ``affine`` the prompt's ranking within the load bound."""
        index = self.policy.pick([e.url for e in candidates], [e.outstanding for e in candidates],
                                 None if prompt is None else prompt_id(prompt), work, in_flight)
        return candidates[index]

    def _request_body(self, group: GroupResult, index: int, sampling: Sampling, rollout_id: str) -> dict[str, Any]:
        """The completion request of sample ``index`` of ``group`` (sample i is seeded ``seed + i``)."""
        body: dict[str, Any] = {
            "model": self.model, "prompt": group.prompt, "n": 1, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "rollout_id": rollout_id,
            "group_id": group.group_id, "return_token_ids": True, **sampling.extra}
        for key in ("top_k", "stop", "logprobs"):
            if getattr(sampling, key) is not None:
                body[key] = getattr(sampling, key)
        if sampling.seed is not None:
            body["seed"] = sampling.seed + index
        return body

    async def _sample(self, group: GroupResult, index: int, sampling: Sampling, rollout_id: str,
                      home: Endpoint) -> Sample:
        """One sample, retried on other endpoints on retryable failures."""
        sample = await self._sample_once(group, index, sampling, rollout_id, home)
        self._versions.saw(sample.versions)
        return sample

    async def _sample_once(self, group: GroupResult, index: int, sampling: Sampling, rollout_id: str,
                           home: Endpoint) -> Sample:
        body = self._request_body(group, index, sampling, rollout_id)
        if self.divide_after_tokens is not None and len(self.pool.endpoints) > 1:
            return await self._divided_sample(body, home)
        endpoint, tried, last_error, busy = home, set[str](), "", 0
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:  # the first attempt's slot was reserved by its group
                endpoint.outstanding += 1
            try:
                reply = await self._transport.post_when_admitted(endpoint, "/v1/completions", body, busy)
                self.pool.mark_ok(endpoint)
                endpoint.weight_version = reply.get("weight_version") or endpoint.weight_version
                return _to_sample(reply, endpoint.url, attempt)
            except Retryable as error:
                last_error = str(error)
                self.pool.mark_down(endpoint)
            finally:
                endpoint.outstanding -= 1
            tried.add(endpoint.url)
            if attempt == self.max_attempts:
                break
            await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                endpoint = await self._choose(avoid=tried, prompt=group.prompt)
            except NoEndpointAvailable as error:
                raise SamrolloutError(f"{last_error}; then {error}") from None
        raise SamrolloutError(f"failed {self.max_attempts} times, last on {endpoint.url}: {last_error}")

    async def _divided_sample(self, body: dict[str, Any], home: Endpoint) -> Sample:
        """One streamed sample that may move to less loaded endpoints (`samrollout_client.rollouts.divided`).

        A failure mid-sample continues from the last clean cut on another endpoint; a
        continuation the server refuses (4xx: e.g. prompt plus generated tokens over its
        ``--max-prompt-tokens``) restarts the sample from its prompt, and it no longer moves.
        """
        sample = DividedSample(max_tokens=int(body["max_tokens"]), want_logprobs="logprobs" in body)
        seed = body.get("seed")
        base = {**body, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": body.get("logprobs", 0)}  # each token's text tells whether a cut after it is clean
        endpoint, failures, tried, busy = home, 0, set[str](), 0
        while True:
            sample.start_piece(endpoint.url)
            continuing = bool(sample.token_ids)
            try:
                target = await self._stream_piece(endpoint, sample.body(base, seed), sample)
            except Busy as error:  # refused before it started: wait, then ask the same endpoint again
                busy += 1
                if busy > self.max_busy_retries:
                    raise SamrolloutError(f"{error} ({self.max_busy_retries} times; max_busy_retries)") from None
                sample.retract_piece()
                await asyncio.sleep(self._transport.busy_wait_s(error, busy))
                endpoint.outstanding += 1
                continue
            except Retryable as error:
                failures += 1
                self.pool.mark_down(endpoint)
                tried.add(endpoint.url)
                if failures >= self.max_attempts:
                    raise SamrolloutError(f"failed {failures} times, last on {endpoint.url}: {error}") from None
                sample.cut_back()
                await asyncio.sleep(self.backoff_s * 2 ** (failures - 1))
                endpoint = await self._next_endpoint(tried, str(error), body["prompt"])
                continue
            except RequestRejected:
                if not continuing:
                    raise
                sample.restart(may_move=False)
                endpoint = await self._next_endpoint(set(), "", body["prompt"])
                continue
            if target is None:
                return sample.to_sample(endpoint.url, failures + 1)
            sample.load_moves += 1
            endpoint = target  # its outstanding count was raised when it was chosen

    async def _next_endpoint(self, avoid: set[str], last_error: str, prompt: Prompt) -> Endpoint:
        """The endpoint for the next request of a sample of ``prompt``, its outstanding count raised."""
        try:
            endpoint = await self._choose(avoid=avoid, prompt=prompt)
        except NoEndpointAvailable as error:
            raise SamrolloutError(f"{last_error}; then {error}" if last_error else str(error)) from None
        endpoint.outstanding += 1
        return endpoint

    async def _stream_piece(self, endpoint: Endpoint, body: dict[str, Any], sample: DividedSample) -> Endpoint | None:
        """Stream one piece of ``sample``: the endpoint to move to (its count raised), or None once finished.

        Lowers ``endpoint``'s outstanding count when done. Connection problems, 5xx and
        error events -> `Retryable` (unless the sample already finished); 4xx -> `RequestRejected`.
        """
        assert self.divide_after_tokens is not None
        try:
            target = await stream_piece(self._http, endpoint, body, sample, self.pool.endpoints,
                                        self.divide_after_tokens, lambda reply: check_status(endpoint, reply))
        except (*RETRYABLE_ERRORS, StreamError) as error:
            if sample.finish_reason is None:
                raise Retryable(f"{endpoint.url}: {type(error).__name__}: {error}") from None
            return None
        self.pool.mark_ok(endpoint)
        if target is None and sample.finish_reason is None:
            raise Retryable(f"{endpoint.url}: the stream ended before the sample finished")
        return target

    # --- weights and admin ----------------------------------------------------------------------

    async def update_weights(self, path: str, version: str, in_flight: InFlight = "wait",
                             timeout_s: float = 600.0) -> None:
        """Load new weights on every endpoint and wait until all of them serve ``version``.

        ``in_flight``: what happens to requests generating meanwhile: they finish on the old weights
        first (``wait``), end with what they have (``abort``), or go on under the new weights in the
        same response (``continue``: what a `partial_rollout` wants).
        """
        check_update(version, in_flight)
        await self._transport.broadcast("/admin/update_weights",
                                        {"path": path, "version": version, "in_flight": in_flight})
        await self._versions.wait_for(version, timeout_s)
        self._versions.served(version)

    async def push_weights(self, weights: WeightsSource, version: str, in_flight: InFlight = "wait",
                           *, shard_bytes: int = DEFAULT_SHARD_BYTES, timeout_s: float = 600.0,
                           fan_out: bool = True) -> WeightPush:
        """Send new weights to every endpoint over HTTP (no shared disk), load them everywhere, wait for ``version``.

        ``weights``: a directory of ``*.safetensors`` files (streamed from disk), or a state dict,
        name -> torch tensor or numpy array, with the served checkpoint's tensor names, shapes and
        dtypes (serialised one shard of at most ``shard_bytes`` tensor bytes at a time, so the
        client holds about two shards' bytes at once), or a stream of such ``(name, tensor)`` pairs
        (an iterator or async iterator, packed into shards as it is read). Each file goes out with
        its SHA-256 (`POST/PUT /admin/weight_uploads`): with ``fan_out`` once per chain of servers
        that relay it to one another (their ``--weight-peers``; about one checkpoint on this
        client's link), to each endpoint directly where no peer reaches it (or with
        ``fan_out=False``). Only once every endpoint holds every file, its SHA-256 checked on
        each, are the uploads committed, each loading them as `update_weights` loads a directory
        (`stage_weights`, then `commit_weights`). A failure anywhere before the commits (on a
        relaying server too) cancels every upload (nothing is loaded anywhere) and raises
        `SamrolloutError` (`RequestRejected` for a 4xx: a bad file, over the server's size bound),
        naming the version each endpoint serves. Commits that all fail (bad tensor names, shapes or
        dtypes: 400) leave every endpoint on its old weights; commits that fail on some endpoints
        only raise `WeightsSplit` (which endpoint serves which version; `commit_weights` on its
        ``staged`` or `roll_back` brings them together). A commit whose answer is lost (a timeout,
        a broken connection) is asked of its server until its outcome is known (within ``timeout_s``),
        so the report is what each server finally serves. ``in_flight`` as for `update_weights`.
        Returns what was sent and how long the upload and the load took.
        """
        check_update(version, in_flight)
        source = WeightFiles(weights, shard_bytes)  # a bad argument fails here, before any request
        return await push_weights(self._transport, self._versions, source, version, in_flight, timeout_s, fan_out)

    async def stage_weights(self, weights: WeightsSource, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                            fan_out: bool = True) -> StagedWeights:
        """`push_weights`' first half: every endpoint receives and checks the files, none loads them yet.

        Commit them later with `commit_weights` (e.g. at a step boundary, the upload having run
        beside generation); uploads left uncommitted expire after the servers'
        ``--weight-upload-idle-seconds``.
        """
        return await stage_weights(self._transport, WeightFiles(weights, shard_bytes), fan_out)

    async def commit_weights(self, staged: StagedWeights, version: str, in_flight: InFlight = "wait",
                             timeout_s: float = 600.0) -> WeightPush:
        """Load staged weights as ``version`` on every endpoint holding them, wait until each serves it.

        ``staged``: what `stage_weights` returned, or a `WeightsSplit`'s ``staged`` (the uploads
        still staged where a commit failed: this tries those commits again). Raises `WeightsSplit`
        when some endpoints load it and others do not (`samrollout_client.weight_sync.weight_commit`).
        """
        check_update(version, in_flight)
        return await commit_weights(self._transport, self._versions, staged, version, in_flight, timeout_s)

    async def roll_back(self, split: WeightsSplit, weights: WeightsSource, version: str | None = None,
                        in_flight: InFlight = "wait", *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                        timeout_s: float = 600.0, fan_out: bool = True) -> WeightPush:
        """Undo a `WeightsSplit`: push ``weights`` (the ones served before it) as ``version`` to the endpoints that
        took the split's version, and cancel the uploads still staged elsewhere. ``version`` None: the version the
        other endpoints still serve."""
        return await roll_back(self._transport, self._versions, split, WeightFiles(weights, shard_bytes), version,
                               in_flight, timeout_s, fan_out)

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Hold generation on every endpoint."""
        await self._transport.broadcast("/admin/pause", {"mode": mode})

    async def resume(self) -> None:
        """Resume generation on every endpoint."""
        await self._transport.broadcast("/admin/resume", None)

    async def sleep(self, level: Literal[1, 2] = 1) -> None:
        """Free accelerator memory on every endpoint (servers started with sleep mode)."""
        await self._transport.broadcast("/admin/sleep", {"level": level})

    async def wake(self) -> None:
        """Restore what `sleep` freed, on every endpoint."""
        await self._transport.broadcast("/admin/wake", None)

    async def abort(self, rollout_id: str) -> int:
        """Abort every in-flight request of ``rollout_id`` on every reachable endpoint; returns how many."""
        replies = await self._transport.post_to_all("/admin/abort_rollout", {"rollout_id": rollout_id})
        return sum(int(r.get("aborted_requests", 0)) for r in replies if isinstance(r, dict))

    async def report(self, rollout_id: str) -> RolloutReport:
        """The rollout's makespan, tail share and acceptance, combined over every endpoint's summary."""
        summaries = []
        for endpoint in self.pool.endpoints:
            try:
                reply = await self._http.get(f"{endpoint.url}/v1/rollouts/{rollout_id}")
            except httpx.HTTPError:
                continue
            if reply.status_code == 200:
                summaries.append(reply.json())
        if not summaries:
            raise SamrolloutError(f"no endpoint knows rollout {rollout_id!r}")
        return combine_summaries(rollout_id, summaries)


class _ClientSampler:
    """The client as its partial rollouts see it (`partial.GroupSampler`): the placement, one sample's
    send with retries, and the version history, without the rest of the client."""

    def __init__(self, client: AsyncRolloutClient) -> None:
        self._client = client

    @property
    def divide_after_tokens(self) -> int | None:
        return self._client.divide_after_tokens

    @property
    def max_in_flight(self) -> int:
        return self._client.max_in_flight

    @property
    def weight_versions(self) -> list[str]:
        return self._client.weight_versions

    async def refresh_versions(self) -> None:
        await self._client._versions.refresh()

    def saw_versions(self, versions: Iterable[str]) -> None:
        self._client._versions.saw(versions, notify=False)

    def listen_for_versions(self, listener: Callable[[], None]) -> None:
        self._client._versions.listen(listener)

    def stop_listening(self, listener: Callable[[], None]) -> None:
        self._client._versions.stop_listening(listener)

    def place(self, prompt: Prompt, work: int, in_flight: int) -> Endpoint | None:
        return self._client._place(prompt, work, in_flight)

    async def choose(self, prompt: Prompt, work: int) -> Endpoint:
        return await self._client._choose(prompt=prompt, work=work)

    async def sample(self, group: GroupResult, index: int, sampling: Sampling, rollout_id: str,
                     home: Endpoint) -> Sample:
        return await self._client._sample(group, index, sampling, rollout_id, home)

    async def abort(self, rollout_id: str) -> int:
        return await self._client.abort(rollout_id)


def _to_sample(reply: dict[str, Any], endpoint: str, attempts: int) -> Sample:
    """A `Sample` from the server's completion response (one choice)."""
    choice = reply["choices"][0]
    spec = (reply.get("metrics") or {}).get("speculative_decoding")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    token_ids = choice.get("token_ids") or []
    version = choice.get("weight_version") or reply.get("weight_version")
    return Sample(text=choice["text"], token_ids=token_ids,
                  prompt_token_ids=choice.get("prompt_token_ids"), logprobs=logprobs,
                  finish_reason=choice.get("finish_reason"), weight_version=version,
                  speculation=SpecStats(**{k: spec[k] for k in SpecStats.model_fields if k in spec}) if spec else None,
                  endpoint=endpoint, attempts=attempts,
                  weight_version_spans=parse_spans(choice.get("weight_version_spans"), len(token_ids), version))
