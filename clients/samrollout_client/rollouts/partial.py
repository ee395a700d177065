"""Partial rollouts for asynchronous RL: each step takes the groups that finished; the rest run on.

    async with client.partial_rollout(prompts, group_size=8, batch_groups=16, max_staleness=1) as rollout:
        async for batch in rollout:                    # 16 whole GRPO groups per step
            loss = train(batch)                        # the samples of unfinished groups keep generating
            await client.push_weights(model.state_dict(), version=str(step), in_flight="continue")

The rollout keeps up to ``max_concurrent_groups`` groups started (default: two batches),
taking a new prompt from ``prompts`` whenever one is returned or given up.  Each group is
``group_size`` one-sample requests with one ``group_id`` on one endpoint (chosen by the
client's ``placement`` when the group starts: by default the prompt's own endpoint within
the load bound, `samrollout_client.placement`), sent as in
`AsyncRolloutClient.generate` (retries, 429s, divided rollout).  `PartialRollout.next_batch`
returns once ``batch_groups`` groups are complete (every sample of each finished; a group
is never split), the stalest first; the samples still generating stay in flight, their HTTP
requests open.  A weight update with ``in_flight="continue"`` lets them go on under the new
weights within the same response, so nothing is generated twice; each `Sample` says which
of its tokens each version sampled (`Sample.weight_version_spans`).

Staleness.  The rollout orders weight versions as this client saw them served
(`AsyncRolloutClient.weight_versions`: the versions its endpoints reported when the rollout
started, each version its own `update_weights` / `push_weights` loaded, and versions first met
in responses, newest last).  A sample's staleness is how many versions its oldest token lags
behind the newest (`Sample.staleness`): 0 if the newest weights sampled all of it; a sample
whose tokens span k versions has staleness at least k - 1.  With ``max_staleness`` (default
`rollout_rules.DEFAULT_MAX_STALENESS`, 2; None: no bound), a finished sample past it is never returned:
``on_stale="restart"`` (the default) sends it again from its prompt under the newest weights
(its group waits for it), ``on_stale="drop"`` gives up its whole group (its requests still
running are cancelled) and starts the next prompt instead.  Finished samples are judged when
they come back, whenever the version changes, and before a batch is chosen; a sample still
generating is judged when it finishes (a non-streamed response tells its spans only at the
end), so a doomed one runs to its end first.  The tokens the client throws away are counted
(`PartialRolloutStats.discarded_tokens`).

A sample that comes back aborted (an update with ``in_flight="abort"``, `abort`) is sent
again from its prompt.  A sample that fails after its retries gives up its group; the next
`next_batch` raises `RolloutFailed` naming it (the rollout goes on if called again).
Closing the rollout cancels every request in flight (the servers abort them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from samrollout_client.arguments import (
    SamplingLike,
    as_sampling,
    check_count,
    check_optional_text,
    check_prompt_stream,
)
from samrollout_client.errors import RolloutFailed, SamrolloutError
from samrollout_client.rollout_rules import (
    DEFAULT_MAX_STALENESS,
    batch_order,
    concurrent_groups,
    staleness,
    too_stale,
)
from samrollout_client.types import (
    GroupResult,
    PartialRolloutStats,
    Prompt,
    Sample,
    SampleFailure,
    Sampling,
    StalePolicy,
    is_prompt,
)

if TYPE_CHECKING:
    from samrollout_client.endpoints import Endpoint

STALE_POLICIES: tuple[StalePolicy, ...] = ("restart", "drop")


class GroupSampler(Protocol):
    """What a partial rollout needs of its client: where a group goes, one sample sent (with the client's
    retries), and the weight versions it has met.  `AsyncRolloutClient` provides one; the rollout depends on
    this and nothing else of the client, so neither module imports the other's internals."""

    @property
    def divide_after_tokens(self) -> int | None:
        """Divided rollout's piece length (None: off); its sampling rules then apply."""

    @property
    def max_in_flight(self) -> int:
        """Requests the client keeps in flight at most."""

    @property
    def weight_versions(self) -> list[str]:
        """The versions met so far, newest last."""

    async def refresh_versions(self) -> None:
        """Ask every endpoint which version it serves."""

    def saw_versions(self, versions: Iterable[str]) -> None:
        """Record versions not met before as the newest, telling no listener."""

    def listen_for_versions(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a newer version is met."""

    def stop_listening(self, listener: Callable[[], None]) -> None:
        """No more calls to ``listener`` (none if it was not listening)."""

    def place(self, prompt: Prompt, work: int, in_flight: int) -> Endpoint | None:
        """The endpoint for ``work`` requests of ``prompt`` among those up now (None: none is up)."""

    async def choose(self, prompt: Prompt, work: int) -> Endpoint:
        """An endpoint for ``work`` requests of ``prompt``, waiting for one to be up."""

    async def sample(self, group: GroupResult, index: int, sampling: Sampling, rollout_id: str,
                     home: Endpoint) -> Sample:
        """Sample ``index`` of ``group``, sent to ``home`` (counted there) and retried elsewhere on failures."""

    async def abort(self, rollout_id: str) -> int:
        """Abort what the servers still run of ``rollout_id``."""


@dataclass(eq=False)
class _Group:
    """A group started and not yet returned or given up."""

    result: GroupResult
    slots: list[Sample | None]
    home: Endpoint | None
    tasks: dict[int, asyncio.Task[Sample]] = field(default_factory=dict)
    over: bool = False  # returned or given up: late results are ignored

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.slots)


class PartialRollout:
    """A stream of GRPO batches over a prompt iterable, unfinished samples carried into the next step.

    Made by `AsyncRolloutClient.partial_rollout` (see there and the module docstring); use it
    as ``async with`` (or call `aclose`), and take batches with `next_batch` or ``async for``.
    """

    def __init__(self, client: GroupSampler, prompts: Iterable[Prompt], *, group_size: int,
                 batch_groups: int, sampling: SamplingLike = None,
                 max_staleness: int | None = DEFAULT_MAX_STALENESS,
                 on_stale: StalePolicy = "restart", max_concurrent_groups: int | None = None,
                 rollout_id: str | None = None) -> None:
        check_prompt_stream(prompts)
        check_count("group_size", group_size)
        check_count("batch_groups", batch_groups)
        check_optional_text("rollout_id", rollout_id)
        if max_staleness is not None:
            check_count("max_staleness (None: no bound)", max_staleness, minimum=0)
        if on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale must be one of {STALE_POLICIES}, got {on_stale!r}")
        concurrent = concurrent_groups(batch_groups, max_concurrent_groups)
        self.sampling = as_sampling(sampling)
        if client.divide_after_tokens is not None:
            from samrollout_client.rollouts.divided import check_divisible

            check_divisible(self.sampling)
        self.group_size, self.batch_groups, self.max_concurrent_groups = group_size, batch_groups, concurrent
        self.max_staleness, self.on_stale = max_staleness, on_stale
        self.rollout_id = rollout_id or f"partial-{uuid.uuid4().hex[:12]}"
        self.stats = PartialRolloutStats()
        self._client = client
        self._prompts: Iterator[Prompt] = iter(prompts)
        self._exhausted = False
        self._prompt_error: BaseException | None = None
        self._groups: dict[int, _Group] = {}
        self._next_index = 0
        self._failures: list[SampleFailure] = []
        self._position: dict[str, int] = {}
        self._position_key: tuple[int, str] | None = None
        self._changed = asyncio.Event()
        self._gate = asyncio.Semaphore(client.max_in_flight)
        # Samples launched and not yet running: the endpoint counted for each (its outstanding count raised at
        # launch, so that groups placed before they start see each other's load).
        self._reserved: dict[asyncio.Task[Sample], Endpoint] = {}
        self._started = self._closed = False

    # --- what the trainer reads -----------------------------------------------------------------

    @property
    def versions(self) -> list[str]:
        """Weight versions in the order they were served, newest last (the client's `weight_versions`)."""
        return self._client.weight_versions

    @property
    def running(self) -> int:
        """Samples generating now (sent, or waiting for one of the client's ``max_in_flight`` slots)."""
        return sum(len(g.tasks) for g in self._groups.values())

    @property
    def held_groups(self) -> int:
        """Groups started and not yet returned or given up."""
        return len(self._groups)

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Learn the version served and start the first groups (`next_batch` and ``async with`` call it)."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("this partial rollout is closed")
        self._started = True
        await self._client.refresh_versions()
        self._client.listen_for_versions(self._on_new_version)
        self._fill()

    async def __aenter__(self) -> PartialRollout:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every request in flight (the servers abort them) and stop taking prompts."""
        if self._closed:
            return
        self._closed = True
        self._changed.set()  # a next_batch waiting raises
        self._client.stop_listening(self._on_new_version)
        tasks = [t for g in self._groups.values() for t in g.tasks.values()]
        for group in self._groups.values():
            group.over = True
        self._groups.clear()
        self.stats.cancelled_requests += _cancel(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks:
            with contextlib.suppress(SamrolloutError):
                await self._client.abort(self.rollout_id)  # anything a closed connection left running

    def __aiter__(self) -> PartialRollout:
        return self

    async def __anext__(self) -> list[GroupResult]:
        batch = await self.next_batch()
        if not batch:
            raise StopAsyncIteration
        return batch

    # --- batches ----------------------------------------------------------------------------------

    async def next_batch(self, groups: int | None = None, timeout_s: float | None = None) -> list[GroupResult]:
        """The next ``groups`` (default ``batch_groups``) complete groups, the stalest first (then in prompt order);
        samples still generating stay in flight.

        Returns fewer only once the prompts are used up and nothing else is generating, and []
        when nothing is left.  Raises `RolloutFailed` if samples failed since the last call (their
        groups are given up; the rollout goes on if called again), TimeoutError after
        ``timeout_s`` (nothing is lost: the groups stay for the next call).
        """
        want = self.batch_groups if groups is None else groups
        if not 1 <= want <= self.max_concurrent_groups:
            raise ValueError(f"groups must be from 1 to max_concurrent_groups ({self.max_concurrent_groups}), "
                             f"got {want}")
        await self.start()
        if self._closed:
            raise RuntimeError("this partial rollout is closed")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for group in list(self._groups.values()):
            self._judge(group)  # (each new version and each finished sample is judged as it comes, too)
        while True:
            if self._closed:
                raise RuntimeError("this partial rollout was closed")
            self._raise_problems()
            self._fill()
            ready = [g for g in self._groups.values() if g.complete]
            if len(ready) >= want or (len(ready) == len(self._groups) and self._exhausted):
                break
            self._changed.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"partial rollout {self.rollout_id}: {len(ready)} of {want} groups complete "
                                   f"after {timeout_s} s")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        ready = batch_order(ready, self._staleness, lambda g: g.result.index)
        batch: list[GroupResult] = []
        for group in ready[:want]:
            samples = [s for s in group.slots if s is not None]
            group.result.samples, group.over = samples, True
            del self._groups[group.result.index]
            self.stats.groups_returned += 1
            self.stats.samples_returned += len(samples)
            self.stats.tokens_returned += sum(len(s.token_ids) for s in samples)
            self.stats.mixed_version_samples += sum(len(s.versions) > 1 for s in samples)
            self.stats.max_staleness_returned = max(self.stats.max_staleness_returned, self._staleness(group))
            batch.append(group.result)
        if batch:
            self.stats.batches += 1
            self.stats.carried_over += self.running
        self._fill()
        return batch

    # --- internals --------------------------------------------------------------------------------

    def _raise_problems(self) -> None:
        if self._failures:
            failures, self._failures = self._failures, []
            raise RolloutFailed(f"partial rollout {self.rollout_id}: {len(failures)} group(s) given up", failures,
                                [])
        if self._prompt_error is not None:
            error, self._prompt_error = self._prompt_error, None
            raise error

    def _fill(self) -> None:
        """Start groups from the prompts until ``max_concurrent_groups`` are held."""
        while not self._closed and not self._exhausted and len(self._groups) < self.max_concurrent_groups:
            try:
                prompt = next(self._prompts)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as error:  # the trainer's own iterator failed: raised by the next next_batch
                self._exhausted, self._prompt_error = True, error
                break
            index = self._next_index
            self._next_index += 1
            self.stats.groups_started += 1
            if not is_prompt(prompt):
                self._failures.append(SampleFailure(group=index, sample=0, error=f"prompt {index} must be a string "
                                                    "or a non-empty list of token ids"))
                self.stats.groups_failed += 1
                continue
            result = GroupResult(index=index, prompt=prompt, group_id=f"{self.rollout_id}.g{index}", samples=[])
            group = _Group(result=result, slots=[None] * self.group_size,
                           home=self._client.place(prompt, self.group_size,
                                                   in_flight=self.max_concurrent_groups * self.group_size))
            self._groups[index] = group
            for sample in range(self.group_size):
                self._launch(group, sample)

    def _launch(self, group: _Group, index: int) -> None:
        """Start sample ``index`` of ``group``, counted on the group's endpoint from now (as `generate` reserves)."""
        task = asyncio.create_task(self._run_sample(group, index))
        if group.home is not None:
            group.home.outstanding += 1
            self._reserved[task] = group.home
        group.tasks[index] = task
        task.add_done_callback(lambda done: self._done(group, index, done))

    async def _home_for(self, group: _Group) -> Endpoint:
        """The endpoint this sample runs on, its outstanding count raised: the one reserved at launch while it is
        up, else the group's (chosen again by the placement when it is down)."""
        task = asyncio.current_task()
        reserved = self._reserved.pop(task, None) if task is not None else None
        if reserved is not None and not reserved.down:
            return reserved
        if reserved is not None:
            reserved.outstanding -= 1
        home = group.home
        if home is None or home.down:
            home = group.home = await self._client.choose(group.result.prompt, work=1)
        home.outstanding += 1
        return home

    def _release_unstarted(self, task: asyncio.Task[Sample]) -> None:
        """A sample cancelled before it ran: uncount it from the endpoint reserved at launch."""
        reserved = self._reserved.pop(task, None)
        if reserved is not None:
            reserved.outstanding -= 1

    async def _run_sample(self, group: _Group, index: int) -> Sample:
        client = self._client
        home = await self._home_for(group)  # counted: released by the sample's request
        sent = False
        try:
            async with self._gate:
                sent = True
                return await client.sample(group.result, index, self.sampling, self.rollout_id, home)
        finally:
            if not sent:
                home.outstanding -= 1

    def _done(self, group: _Group, index: int, task: asyncio.Task[Sample]) -> None:
        self._release_unstarted(task)
        if task.cancelled() or group.tasks.get(index) is not task:
            return
        del group.tasks[index]
        error = task.exception()
        if group.over:
            if error is None:
                self.stats.discarded_tokens += len(task.result().token_ids)
            return
        if error is not None:
            self._failures.append(SampleFailure(group=group.result.index, sample=index,
                                                error=str(error) if isinstance(error, SamrolloutError)
                                                else f"{type(error).__name__}: {error}"))
            self.stats.groups_failed += 1
            self._give_up(group)
        else:
            sample = task.result()
            if sample.finish_reason == "abort" and not self._closed:
                self.stats.restarted_aborted += 1
                self.stats.discarded_tokens += len(sample.token_ids)
                self._launch(group, index)
            else:
                group.slots[index] = sample
                self._judge(group)
        self._changed.set()

    def _positions(self, versions: list[str]) -> dict[str, int]:
        """Each version's place in `versions` (built again only when the history changed), ``versions`` included."""
        history = self.versions
        if any(v not in self._position for v in versions) or self._position_key != (len(history), history[-1]):
            self._client.saw_versions(versions)  # met only now: the newest
            self._position = {version: index for index, version in enumerate(history)}
            self._position_key = (len(history), history[-1])
        return self._position

    def _sample_staleness(self, sample: Sample) -> int:
        """`Sample.staleness` against `versions`, without building the history's index for every sample."""
        versions = sample.versions
        if not versions:
            return 0
        position = self._positions(versions)
        return staleness(len(self.versions) - 1, min(position[v] for v in versions))

    def _staleness(self, group: _Group) -> int:
        """The largest staleness of the group's finished samples."""
        return max((self._sample_staleness(s) for s in group.slots if s is not None), default=0)

    def _judge(self, group: _Group) -> None:
        """Restart the group's finished samples past ``max_staleness``, or give the group up (``drop``)."""
        if self.max_staleness is None or group.over:
            return
        for index, sample in enumerate(group.slots):
            if sample is None or not too_stale(self._sample_staleness(sample), self.max_staleness):
                continue
            if self.on_stale == "drop":
                self.stats.groups_dropped += 1
                self._give_up(group)
                return
            self.stats.restarted_stale += 1
            self.stats.discarded_tokens += len(sample.token_ids)
            group.slots[index] = None
            self._launch(group, index)

    def _give_up(self, group: _Group) -> None:
        """Cancel the group's requests, count its finished samples as discarded, and start the next prompt."""
        group.over = True
        self._groups.pop(group.result.index, None)
        self.stats.discarded_tokens += sum(len(s.token_ids) for s in group.slots if s is not None)
        tasks, group.tasks = list(group.tasks.values()), {}
        self.stats.discarded_tokens += sum(len(t.result().token_ids) for t in tasks
                                           if t.done() and not t.cancelled() and t.exception() is None)
        self.stats.cancelled_requests += _cancel(tasks)
        self._fill()

    def _on_new_version(self) -> None:
        """A newer version is served: judge every finished sample again, wake `next_batch`."""
        for group in list(self._groups.values()):
            self._judge(group)
        self._changed.set()


def _cancel(tasks: list[asyncio.Task[Sample]]) -> int:
    """Cancel the tasks not done yet; how many."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    return len(pending)
