"""The bounded queue: how many sequences the server accepts beyond those its engine runs (``--max-queued-requests``).

Each generation request holds its sequences (prompts x n) from admission until its response
ends, streamed or not, disconnected or not: the hold is kept in the request's ASGI scope and
released by `ReleaseQueueHolds`, which wraps every request.  A request that would raise the
held sequences past the engine's slots (``max_num_seqs``) plus ``max_queued`` is refused with
429 and ``Retry-After``, before it reaches the engine; the Python client waits and retries.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from samrollout.server.errors import ApiError

logger = logging.getLogger("samrollout.server")

RETRY_AFTER_S = 2  # what a 429 asks the client to wait: about a decode step's worth of slots freeing up
_HOLD_KEY = "samrollout.queue_hold"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class QueueLimit:
    """Sequences held by requests in progress, bounded by the engine's slots plus ``max_queued``."""

    def __init__(self, engine_slots: int, max_queued: int) -> None:
        self.engine_slots, self.max_queued = engine_slots, max_queued
        self.held = 0

    @property
    def capacity(self) -> int:
        """Most sequences held at once."""
        return self.engine_slots + self.max_queued

    def admit(self, scope: Scope, sequences: int) -> None:
        """Hold ``sequences`` for the request of ``scope`` until it ends; ApiError 429 when they do not fit."""
        if self.held + sequences > self.capacity and self.held > 0:
            raise ApiError(429, f"the server is full: {self.held} sequences in progress, {sequences} more asked, at "
                           f"most {self.capacity} ({self.engine_slots} running + --max-queued-requests "
                           f"{self.max_queued}); retry after {RETRY_AFTER_S} s",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += sequences
        scope[_HOLD_KEY] = scope.get(_HOLD_KEY, 0) + sequences

    def release(self, scope: Scope) -> None:
        """Give back what the request of ``scope`` holds (nothing if it held nothing)."""
        self.held -= scope.pop(_HOLD_KEY, 0)

    def status(self) -> dict[str, int]:
        """Held sequences and the bound, for ``/admin/status``."""
        return {"held_sequences": self.held, "capacity": self.capacity, "max_queued": self.max_queued}


class ReleaseQueueHolds:
    """ASGI middleware: whatever a request held in the queue is released when its handling ends, however it ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        """Run the request; then release its hold on the runtime's `QueueLimit`."""
        try:
            await self.app(scope, receive, send)
        finally:
            if _HOLD_KEY in scope:
                runtime = getattr(scope["app"].state, "runtime", None)
                if runtime is not None:
                    runtime.queue.release(scope)
