"""The synchronous client: the same API as `AsyncRolloutClient`, for loops that are not async."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

from samrollout_client.arguments import SamplingLike
from samrollout_client.client import AsyncRolloutClient
from samrollout_client.protocol.modes import InFlight, PauseMode
from samrollout_client.rollout_rules import DEFAULT_MAX_STALENESS
from samrollout_client.rollouts.partial import PartialRollout
from samrollout_client.types import (
    GroupResult,
    PartialRolloutStats,
    Prompt,
    RolloutReport,
    StalePolicy,
    WeightPush,
)
from samrollout_client.weight_sync.weight_commit import WeightsSplit
from samrollout_client.weight_sync.weight_files import DEFAULT_SHARD_BYTES, WeightsSource
from samrollout_client.weight_sync.weight_push import StagedWeights

T = TypeVar("T")


class RolloutClient:
    """Runs an `AsyncRolloutClient` on a private event loop thread (safe inside Jupyter or other loops).

    ``options`` are `AsyncRolloutClient`'s keyword arguments (``api_key``, ``max_in_flight``,
    ``placement``, ``divide_after_tokens``, ...).
    """

    def __init__(self, endpoints: str | Sequence[str], model: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="samrollout-client", daemon=True)
        self._thread.start()
        self._client = self._run(self._make(endpoints, model, options))

    @staticmethod
    async def _make(endpoints: str | Sequence[str], model: str, options: dict[str, Any]) -> AsyncRolloutClient:
        return AsyncRolloutClient(endpoints, model, **options)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate(self, prompts: Sequence[Prompt], n: int = 8, sampling: SamplingLike = None,
                 rollout_id: str | None = None, timeout_s: float | None = None) -> list[GroupResult]:
        """See `AsyncRolloutClient.generate`."""
        return self._run(self._client.generate(prompts, n, sampling, rollout_id, timeout_s))

    def partial_rollout(self, prompts: Iterable[Prompt], group_size: int = 8, *, batch_groups: int,
                        sampling: SamplingLike = None,
                        max_staleness: int | None = DEFAULT_MAX_STALENESS,
                        on_stale: StalePolicy = "restart", max_concurrent_groups: int | None = None,
                        rollout_id: str | None = None) -> SyncPartialRollout:
        """See `AsyncRolloutClient.partial_rollout` (``prompts`` is read on the client's loop thread)."""
        return SyncPartialRollout(self, self._client.partial_rollout(
            prompts, group_size, batch_groups=batch_groups, sampling=sampling, max_staleness=max_staleness,
            on_stale=on_stale, max_concurrent_groups=max_concurrent_groups, rollout_id=rollout_id))

    @property
    def weight_versions(self) -> list[str]:
        """See `AsyncRolloutClient.weight_versions` (a copy)."""
        return self._run(self._copy_versions())

    async def _copy_versions(self) -> list[str]:
        return list(self._client.weight_versions)

    def update_weights(self, path: str, version: str, in_flight: InFlight = "wait") -> None:
        """See `AsyncRolloutClient.update_weights`."""
        self._run(self._client.update_weights(path, version, in_flight))

    def push_weights(self, weights: WeightsSource, version: str, in_flight: InFlight = "wait",
                     *, shard_bytes: int = DEFAULT_SHARD_BYTES, timeout_s: float = 600.0,
                     fan_out: bool = True) -> WeightPush:
        """See `AsyncRolloutClient.push_weights`."""
        return self._run(self._client.push_weights(weights, version, in_flight, shard_bytes=shard_bytes,
                                                   timeout_s=timeout_s, fan_out=fan_out))

    def stage_weights(self, weights: WeightsSource, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                      fan_out: bool = True) -> StagedWeights:
        """See `AsyncRolloutClient.stage_weights`."""
        return self._run(self._client.stage_weights(weights, shard_bytes=shard_bytes, fan_out=fan_out))

    def commit_weights(self, staged: StagedWeights, version: str, in_flight: InFlight = "wait",
                       timeout_s: float = 600.0) -> WeightPush:
        """See `AsyncRolloutClient.commit_weights`."""
        return self._run(self._client.commit_weights(staged, version, in_flight, timeout_s))

    def roll_back(self, split: WeightsSplit, weights: WeightsSource, version: str | None = None,
                  in_flight: InFlight = "wait", *, shard_bytes: int = DEFAULT_SHARD_BYTES, timeout_s: float = 600.0,
                  fan_out: bool = True) -> WeightPush:
        """See `AsyncRolloutClient.roll_back`."""
        return self._run(self._client.roll_back(split, weights, version, in_flight, shard_bytes=shard_bytes,
                                                timeout_s=timeout_s, fan_out=fan_out))

    def pause(self, mode: PauseMode = "keep") -> None:
        """See `AsyncRolloutClient.pause`."""
        self._run(self._client.pause(mode))

    def resume(self) -> None:
        """See `AsyncRolloutClient.resume`."""
        self._run(self._client.resume())

    def sleep(self, level: Literal[1, 2] = 1) -> None:
        """See `AsyncRolloutClient.sleep`."""
        self._run(self._client.sleep(level))

    def wake(self) -> None:
        """See `AsyncRolloutClient.wake`."""
        self._run(self._client.wake())

    def abort(self, rollout_id: str) -> int:
        """See `AsyncRolloutClient.abort`."""
        return self._run(self._client.abort(rollout_id))

    def report(self, rollout_id: str) -> RolloutReport:
        """See `AsyncRolloutClient.report`."""
        return self._run(self._client.report(rollout_id))

    def close(self) -> None:
        """Close connections and stop the loop thread."""
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class SyncPartialRollout:
    """`PartialRollout` for loops that are not async: ``with client.partial_rollout(...) as rollout:``, then
    ``rollout.next_batch()`` or ``for batch in rollout``.  Its requests run on the client's loop thread, so
    they keep generating while the trainer's thread trains."""

    def __init__(self, client: RolloutClient, rollout: PartialRollout) -> None:
        self._client, self.rollout = client, rollout

    @property
    def stats(self) -> PartialRolloutStats:
        """See `PartialRollout.stats` (a copy)."""
        return self._client._run(self._stats())

    async def _stats(self) -> PartialRolloutStats:
        return self.rollout.stats.model_copy()

    async def _running(self) -> int:
        return self.rollout.running

    @property
    def versions(self) -> list[str]:
        """See `PartialRollout.versions` (a copy)."""
        return self._client.weight_versions

    @property
    def running(self) -> int:
        """See `PartialRollout.running`."""
        return self._client._run(self._running())

    @property
    def rollout_id(self) -> str:
        """The rollout id every request of it carries."""
        return self.rollout.rollout_id

    def next_batch(self, groups: int | None = None, timeout_s: float | None = None) -> list[GroupResult]:
        """See `PartialRollout.next_batch`."""
        return self._client._run(self.rollout.next_batch(groups, timeout_s))

    def close(self) -> None:
        """See `PartialRollout.aclose`."""
        self._client._run(self.rollout.aclose())

    def __enter__(self) -> SyncPartialRollout:
        self._client._run(self.rollout.start())
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[list[GroupResult]]:
        while batch := self.next_batch():
            yield batch
