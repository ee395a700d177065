"""The synchronous client: the same API as `AsyncRolloutClient`, for loops that are not async."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, Literal, TypeVar

from samrollout_client.client import AsyncRolloutClient
from samrollout_client.types import GroupResult, Prompt, RolloutReport, Sampling, WeightPush
from samrollout_client.weights import DEFAULT_SHARD_BYTES, WeightsSource

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

    def generate(self, prompts: Sequence[Prompt], n: int = 8, sampling: Sampling | None = None,
                 rollout_id: str | None = None, timeout_s: float | None = None) -> list[GroupResult]:
        """See `AsyncRolloutClient.generate`."""
        return self._run(self._client.generate(prompts, n, sampling, rollout_id, timeout_s))

    def update_weights(self, path: str, version: str, in_flight: Literal["wait", "abort"] = "wait") -> None:
        """See `AsyncRolloutClient.update_weights`."""
        self._run(self._client.update_weights(path, version, in_flight))

    def push_weights(self, weights: WeightsSource, version: str, in_flight: Literal["wait", "abort"] = "wait",
                     *, shard_bytes: int = DEFAULT_SHARD_BYTES, timeout_s: float = 600.0) -> WeightPush:
        """See `AsyncRolloutClient.push_weights`."""
        return self._run(self._client.push_weights(weights, version, in_flight, shard_bytes=shard_bytes,
                                                   timeout_s=timeout_s))

    def pause(self, mode: Literal["keep", "wait", "abort"] = "keep") -> None:
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
