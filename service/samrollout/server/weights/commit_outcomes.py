"""What became of each weight upload's commit, kept by upload id, so that a client that lost the answer can ask.

A commit (``POST /admin/weight_uploads/{id}/commit``) runs to its end on the server whether or not
its caller is still there: the checks, then the load.  A client whose commit request timed out or
whose connection broke does not know whether the server loaded the weights; it asks
``GET /admin/weight_uploads/{id}/commit`` until the outcome is known (`samrollout_client`'s
`weight_commit`), so that what it reports is what the server serves.  The last `KEPT_OUTCOMES`
outcomes are kept (a few hundred bytes each).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from samrollout.server.errors import ApiError

CommitState = Literal["pending", "loaded", "failed"]
KEPT_OUTCOMES = 256  # outcomes remembered; the oldest is forgotten first
_SHOWN_ERROR_CHARS = 2000


@dataclass
class CommitOutcome:
    """One commit: pending while it runs, then loaded (as ``version``) or failed (``error``, ``status``)."""

    upload_id: str
    version: str
    state: CommitState = "pending"
    error: str | None = None
    status: int | None = None   # the HTTP status the commit answered with when it failed
    finished_at: float | None = None

    def shown(self) -> dict[str, Any]:
        """As ``GET /admin/weight_uploads/{id}/commit`` answers it."""
        return {"upload_id": self.upload_id, "state": self.state, "version": self.version, "error": self.error,
                "status": self.status, "finished_at": self.finished_at}


class CommitOutcomes:
    """The outcomes of the latest commits, by upload id."""

    def __init__(self, kept: int = KEPT_OUTCOMES) -> None:
        self._kept = kept
        self._outcomes: OrderedDict[str, CommitOutcome] = OrderedDict()

    def started(self, upload_id: str, version: str) -> CommitOutcome:
        """A commit of ``upload_id`` as ``version`` begins (pending)."""
        outcome = self._outcomes[upload_id] = CommitOutcome(upload_id, version)
        while len(self._outcomes) > self._kept:
            self._outcomes.popitem(last=False)
        return outcome

    @staticmethod
    def loaded(outcome: CommitOutcome) -> None:
        """The commit loaded its weights."""
        outcome.state, outcome.finished_at = "loaded", round(time.time(), 3)

    @staticmethod
    def failed(outcome: CommitOutcome, error: BaseException) -> None:
        """The commit ended without loading (its files refused, or the load failed): the served weights are kept."""
        outcome.state, outcome.finished_at = "failed", round(time.time(), 3)
        outcome.status = error.status if isinstance(error, ApiError) else 500
        message = error.message if isinstance(error, ApiError) else f"{type(error).__name__}: {error}"
        outcome.error = message[:_SHOWN_ERROR_CHARS]

    def get(self, upload_id: str) -> CommitOutcome:
        """The outcome of ``upload_id``'s commit; ApiError 404 when no commit of it is known."""
        outcome = self._outcomes.get(upload_id)
        if outcome is None:
            raise ApiError(404, f"no commit of weight upload {upload_id[:80]!r} is known: it was never committed "
                           f"(or it is older than the last {self._kept} commits)", "upload_id")
        return outcome
