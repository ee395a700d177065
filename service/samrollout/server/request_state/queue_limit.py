"""The bounded queue: how many sequences the server accepts beyond those its engine runs (``--max-queued-requests``).

Each generation request holds its sequences (prompts x n) from admission until its response
ends, streamed or not, disconnected or not: its `RequestLife` (`server.api.request_life`) releases
the hold at the end of the request's ASGI call (`request_end`).  A request that would raise the
held sequences past the engine's slots (``max_num_seqs``) plus ``max_queued`` is refused with
429 and ``Retry-After``, before it reaches the engine; the Python client waits and retries.
"""

from __future__ import annotations

from samrollout.server.errors import ApiError

RETRY_AFTER_S = 2  # what a 429 asks the client to wait: about a decode step's worth of slots freeing up


class QueueLimit:
    """Sequences held by requests in progress, bounded by the engine's slots plus ``max_queued``."""

    def __init__(self, engine_slots: int, max_queued: int) -> None:
        self.engine_slots, self.max_queued = engine_slots, max_queued
        self.held = 0

    @property
    def capacity(self) -> int:
        """Most sequences held at once."""
        return self.engine_slots + self.max_queued

    def admit(self, sequences: int) -> None:
        """Hold ``sequences`` until `release`; ApiError 429 when they do not fit."""
        if self.held + sequences > self.capacity and self.held > 0:
            raise ApiError(429, f"the server is full: {self.held} sequences in progress, {sequences} more asked, at "
                           f"most {self.capacity} ({self.engine_slots} running + --max-queued-requests "
                           f"{self.max_queued}); retry after {RETRY_AFTER_S} s",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += sequences

    def release(self, sequences: int) -> None:
        """Give back ``sequences`` held by `admit`."""
        self.held -= sequences

    def status(self) -> dict[str, int]:
        """Held sequences and the bound, for ``/admin/status``."""
        return {"held_sequences": self.held, "capacity": self.capacity, "max_queued": self.max_queued}
