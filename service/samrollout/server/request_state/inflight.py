"""Which engine requests are in flight, by rollout id: what `/admin/abort_rollout` aborts.

vLLM's serving layer names engine requests after the HTTP request's id (`engine_ids`).  We record the id,
the kind and the prompt count while the HTTP request runs, so a rollout's requests can be aborted without
touching anyone else's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from samrollout.server.request_state.engine_ids import engine_request_ids


@dataclass(frozen=True)
class InflightRequest:
    """One HTTP generation request as the engine knows it."""

    base_id: str
    kind: str  # "completion" or "chat"
    prompts: int
    rollout_id: str | None

    def engine_ids(self) -> list[str]:
        """The external request ids vLLM's serving layer gives this request's engine requests."""
        return engine_request_ids(self.kind, self.base_id, self.prompts)


class InflightRegistry:
    """In-flight generation requests, indexed by rollout id (single event loop: no locking needed)."""

    def __init__(self) -> None:
        self._requests: dict[str, InflightRequest] = {}

    @contextmanager
    def track(self, request: InflightRequest) -> Iterator[InflightRequest]:
        """Record ``request`` for as long as the block runs."""
        self._requests[request.base_id] = request
        try:
            yield request
        finally:
            self._requests.pop(request.base_id, None)

    def engine_ids(self, requests: list[InflightRequest] | None = None) -> list[str]:
        """The engine request ids of ``requests`` (default: every request in flight)."""
        chosen = list(self._requests.values()) if requests is None else requests
        return [engine_id for request in chosen for engine_id in request.engine_ids()]

    def of_rollout(self, rollout_id: str) -> list[InflightRequest]:
        """The in-flight requests tagged with ``rollout_id``."""
        return [r for r in self._requests.values() if r.rollout_id == rollout_id]

    def __len__(self) -> int:
        return len(self._requests)
