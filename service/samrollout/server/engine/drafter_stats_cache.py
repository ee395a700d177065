"""The drafter's stats, asked of vLLM's worker only when the engine may have stepped since they were last read.

Each read is a ``collective_rpc`` to the worker, and vLLM's worker busy-polls its message queue
for a second after every message (vLLM's ``SpinCondition``, ``busy_loop_s=1``): a Prometheus
scraping ``/metrics`` every second, or a dashboard polling ``/admin/status``, kept an idle CPU
server's worker spinning a whole core, which on a laptop is the core the trainer trains on
(a synchronous GRPO step's gradient took 29 s beside it instead of 16 s). Stats change only
when the engine steps, and it steps only while it has requests: when none was unfinished at the
last read, none is now, and no request reached the engine in between, the last read is returned.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from samrollout.spec_decode.stats import ProposerStats


class EngineActivity:
    """Counts the requests that reach the engine (`note_request`) and says whether it has any unfinished."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.requests = 0

    def note_request(self) -> None:
        """One more request reached the engine."""
        self.requests += 1

    def busy(self) -> bool:
        """Whether the engine holds unfinished requests (its output processor's view; no call to the worker)."""
        processor = getattr(self._engine, "output_processor", None)
        return processor is None or bool(processor.has_unfinished_requests())


class DrafterStatsCache:
    """The last stats read from the worker, reused while the engine has provably not stepped since."""

    def __init__(self, read: Callable[[], Awaitable[ProposerStats | None]], activity: EngineActivity) -> None:
        self._read, self._activity = read, activity
        self._stats: ProposerStats | None = None
        self._quiet_after: int | None = None  # request count at a read made with the engine idle before and after

    async def get(self) -> ProposerStats | None:
        """The drafter's stats now: read from the worker, unless nothing can have changed them since the last read."""
        if self._quiet_after == self._activity.requests and not self._activity.busy():
            return self._stats
        requests, idle_before = self._activity.requests, not self._activity.busy()
        stats = await self._read()
        idle = idle_before and not self._activity.busy() and requests == self._activity.requests
        self._stats, self._quiet_after = stats, requests if idle else None
        return stats

    def forget(self) -> None:
        """Read afresh next time (the drafters were reset, e.g. by a weight update)."""
        self._quiet_after = None
