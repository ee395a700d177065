"""Staged weights loaded on every server, and what to do when only some of them loaded (`WeightsSplit`).

A push stages the files everywhere first (`weight_push`), so nothing is loaded until every
server holds them all.  The commits are then one request per server, each loading its own
upload: if a server dies or refuses between the last upload and its commit, the others serve the
new version and it does not.  `commit_weights` never lets that pass silently:

- every commit succeeded: it waits until each server serves the version.  A commit whose answer
  was lost (a timeout, a broken connection) is not taken as failed: the server runs it to its end
  anyway, so its outcome is asked of the server (``GET /admin/weight_uploads/{id}/commit``,
  `commit_outcome`) until known, and the report says what each server finally serves;
- none succeeded: no server loaded anything; the still-staged uploads are cancelled and the
  first failure is raised (a `RequestRejected` stays one), naming what each server serves;
- some succeeded: `WeightsSplit`, naming which server serves which version, why each commit
  failed, and which uploads are still staged.  The caller brings the servers together again:
  `commit_weights` on ``split.staged`` retries the commits whose upload is still staged (a
  server refused with 409 while a file was still arriving, say), or `roll_back` loads the
  previous weights on the servers that took the new ones (a server that died holds no upload).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from samrollout_client.endpoints import Endpoint
from samrollout_client.errors import RequestRejected, SamrolloutError
from samrollout_client.protocol.modes import InFlight
from samrollout_client.transport import Retryable, Transport, Unreachable
from samrollout_client.types import WeightPush
from samrollout_client.weight_sync.versions import VersionTracker
from samrollout_client.weight_sync.weight_files import WeightFiles
from samrollout_client.weight_sync.weight_push import (
    StagedWeights,
    UploadTarget,
    cancel_uploads,
    naming_versions,
    served_versions,
    stage_weights,
    versions_text,
)

OUTCOME_POLL_S = 0.5  # how often a commit whose answer was lost is asked after


class CommitOutcomeUnknown(SamrolloutError):
    """A commit's answer was lost and its server has not said, by the push's timeout, whether it loaded."""


@dataclass(frozen=True)
class EndpointWeights:
    """One server after a commit: the version it serves now (None: it does not answer), whether its upload of the
    push is still staged (its commit can be tried again), and why its commit failed (None: it committed)."""

    url: str
    version: str | None
    staged: bool = False
    error: str | None = None

    def shown(self) -> str:
        """This server in an error message."""
        serves = f"serves {self.version!r}" if self.version is not None else "does not answer"
        if self.error is None:
            return f"{self.url} {serves}"
        staged = "its upload is still staged" if self.staged else "it holds no upload"
        return f"{self.url} {serves} (its commit failed: {self.error}; {staged})"


class WeightsSplit(SamrolloutError):
    """Weights a push committed on some servers only: each server's version (`endpoints`), the still-staged uploads
    (`staged`, to commit again with `AsyncRolloutClient.commit_weights`) and the pushed ``version``; or undo it with
    `AsyncRolloutClient.roll_back`."""

    def __init__(self, version: str, endpoints: list[EndpointWeights], staged: StagedWeights) -> None:
        failed = sum(state.error is not None for state in endpoints)
        super().__init__(f"the servers serve different weights: the commit of {version!r} failed on {failed} of "
                         f"{len(endpoints)}: " + "; ".join(state.shown() for state in endpoints))
        self.version, self.endpoints, self.staged = version, endpoints, staged

    @property
    def committed(self) -> list[str]:
        """The servers that serve the pushed version."""
        return [state.url for state in self.endpoints if state.version == self.version]


async def push_weights(transport: Transport, versions: VersionTracker, source: WeightFiles, version: str,
                       in_flight: InFlight, timeout_s: float, fan_out: bool = True,
                       endpoints: Sequence[Endpoint] | None = None) -> WeightPush:
    """Stage ``source`` on every endpoint (or each of ``endpoints``), then commit it as ``version``."""
    staged = await stage_weights(transport, source, fan_out, endpoints)
    return await commit_weights(transport, versions, staged, version, in_flight, timeout_s)


async def commit_weights(transport: Transport, versions: VersionTracker, staged: StagedWeights, version: str,
                         in_flight: InFlight, timeout_s: float) -> WeightPush:
    """Load ``staged`` as ``version`` on every endpoint holding it and wait until each serves it (the module
    docstring says what a failure raises)."""
    started = time.monotonic()
    body = {"version": version, "in_flight": in_flight}
    commits = await asyncio.gather(*(_commit(transport, t, body, started + timeout_s) for t in staged.targets),
                                   return_exceptions=True)
    endpoints = [target.endpoint for target in staged.targets]
    failures = [(t, r) for t, r in zip(staged.targets, commits, strict=True) if isinstance(r, BaseException)]
    if failures:
        await _settle_failed(transport, staged, version, failures)
    await versions.wait_for(version, timeout_s, endpoints)
    versions.served(version)
    done = time.monotonic()
    return WeightPush(version=version, endpoints=len(endpoints), files=staged.files, bytes=staged.bytes,
                      bytes_sent=staged.bytes_sent, relay_chains=staged.relay_chains, upload_s=staged.upload_s,
                      load_s=done - started, seconds=staged.upload_s + done - started)


async def _commit(transport: Transport, target: UploadTarget, body: dict[str, Any],
                  deadline: float) -> dict[str, Any]:
    """Commit ``target``'s upload; when the answer is lost (a timeout, a broken connection, a 5xx), the commit's
    outcome as its server tells it (`commit_outcome`): the push reports what each server finally serves."""
    try:
        return await transport.post(target.endpoint, f"/admin/weight_uploads/{target.upload_id}/commit", body)
    except Unreachable:
        raise  # the commit never reached the server: nothing loaded there
    except Retryable as lost:
        return await commit_outcome(transport, target, lost, deadline)


async def commit_outcome(transport: Transport, target: UploadTarget, lost: BaseException,
                         deadline: float) -> dict[str, Any]:
    """Ask ``target``'s server for its commit's outcome (``GET .../{id}/commit``) until it is known: its answer
    when loaded; the commit's error when it failed, or ``lost`` when the server knows no commit of it (it never
    arrived) or refuses connections (it died: a server started again holds no upload); `CommitOutcomeUnknown` when
    the server still gives none at ``deadline`` (clock of time.monotonic)."""
    path = f"/admin/weight_uploads/{target.upload_id}/commit"
    while True:
        try:
            outcome = await transport.get(target.endpoint, path)
        except RequestRejected as refused:
            if refused.status == 404:
                raise lost from None  # no commit of it reached the server: nothing loaded
            raise
        except Unreachable:
            raise lost from None  # the server is gone (a restarted server holds no upload): it loads nothing now
        except Retryable:
            outcome = {"state": "pending"}  # the server does not answer in time now: ask again
        if outcome.get("state") == "loaded":
            return outcome
        if outcome.get("state") == "failed":
            status = int(outcome.get("status") or 500)
            if status >= 500:
                raise Retryable(f"{target.endpoint.url}: its commit failed ({status}): {outcome.get('error')}")
            raise RequestRejected(target.endpoint.url, status, str(outcome.get("error")))
        if time.monotonic() >= deadline:
            raise CommitOutcomeUnknown(f"{target.endpoint.url}: the commit's answer was lost ({lost}) and its outcome "
                                       "is still unknown at the push's timeout")
        await asyncio.sleep(OUTCOME_POLL_S)


async def _settle_failed(transport: Transport, staged: StagedWeights, version: str,
                         failures: list[tuple[UploadTarget, BaseException]]) -> None:
    """Some commits failed: raise `WeightsSplit` when others loaded ``version``; else cancel what is still staged and
    raise the first failure, naming each server's version."""
    endpoints = [target.endpoint for target in staged.targets]
    now = await served_versions(transport, endpoints)
    failed = {target.upload_id: error for target, error in failures}
    still = await asyncio.gather(*(_still_staged(transport, t) if t.upload_id in failed else _false()
                                   for t in staged.targets))
    states = [EndpointWeights(t.endpoint.url, served, held,
                              None if t.upload_id not in failed or served == version else str(failed[t.upload_id]))
              for t, served, held in zip(staged.targets, now, still, strict=True)]
    if any(state.version == version for state in states):
        kept = [t for t, held in zip(staged.targets, still, strict=True) if held]
        raise WeightsSplit(version, states, replace(staged, targets=kept))
    await cancel_uploads(transport, [t for t, held in zip(staged.targets, still, strict=True) if held])
    first = failures[0][1]
    if not isinstance(first, SamrolloutError):
        raise first
    raise await naming_versions(transport, endpoints, first, "no server loaded the weights") from first


async def _still_staged(transport: Transport, target: UploadTarget) -> bool:
    """Whether ``target``'s upload is still open on its server (its commit can be tried again)."""
    try:
        reply = await transport.http.get(f"{target.endpoint.url}/admin/weight_uploads/{target.upload_id}",
                                         timeout=10.0)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


async def _false() -> bool:
    return False


async def roll_back(transport: Transport, versions: VersionTracker, split: WeightsSplit, source: WeightFiles,
                    version: str | None, in_flight: InFlight, timeout_s: float, fan_out: bool = True) -> WeightPush:
    """Load ``source`` (the weights served before the split) as ``version`` on the servers that took the split's
    version, after cancelling the uploads still staged elsewhere.  ``version`` None: the one version the other
    servers that answer still serve (ValueError when they serve several, or none answers)."""
    if version is None:
        others = {state.version for state in split.endpoints
                  if state.version is not None and state.version != split.version}
        if len(others) != 1:
            raise ValueError(f"roll_back needs the version to load the previous weights as: the other servers serve "
                             f"{sorted(others) or 'nothing that answers'}")
        version = others.pop()
    await cancel_uploads(transport, split.staged.targets)
    targets = [transport.pool.by_url(url) for url in split.committed]
    if not targets:
        now = versions_text([state.url for state in split.endpoints], [state.version for state in split.endpoints])
        raise SamrolloutError(f"no server serves {split.version!r} any more: nothing to roll back ({now})")
    return await push_weights(transport, versions, source, version, in_flight, timeout_s, fan_out, targets)
