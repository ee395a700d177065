"""RL admin routes under /admin (API key required when one is configured).

- ``POST /admin/update_weights`` {path, version, in_flight: "wait"|"abort"|"continue"|"continue-keep-kv"}: new
  policy weights.
- ``POST /admin/pause`` {mode: "keep"|"wait"|"abort"} and ``POST /admin/resume``: hold generation;
  ``POST /admin/step`` {steps}: a held engine runs that many steps and is held again (`engine_steps`).
- ``POST /admin/sleep`` {level} and ``POST /admin/wake``: free and restore accelerator memory.
- ``POST /admin/abort_rollout`` {rollout_id}: abort every in-flight request of one rollout.
- ``POST /admin/reset_prefix_cache``; ``GET /admin/status``: version, paused, sleeping, in flight, drafter,
  the last weight update's cost.
- ``/admin/weight_uploads``, ``/admin/identity``, ``/admin/peers``: weights pushed over HTTP
  (`weight_upload_routes`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from samrollout.server.api.admin_bodies import ADMIN_ERRORS, IN_FLIGHT_HELP, AdminBody
from samrollout.server.api.auth import require_api_key
from samrollout.server.api.rl_fields import ID_PATTERN
from samrollout.server.engine.heap_freeze import frozen_objects
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.errors import ApiError
from samrollout_client.protocol.modes import InFlight, PauseMode

router = APIRouter(prefix="/admin", dependencies=[Depends(require_api_key)])
_UPDATE_ERRORS: dict[int | str, dict[str, Any]] = {**ADMIN_ERRORS,
                                                   403: {"description": "path is outside --weights-root"}}


class UpdateWeights(AdminBody):
    """Where the new weights are, their version tag, and what happens to requests in flight."""

    path: str = Field(min_length=1, description="directory with the new *.safetensors (same architecture)")
    version: str = Field(min_length=1, max_length=128, description="weight version reported with responses")
    in_flight: InFlight = Field("wait", description=IN_FLIGHT_HELP)


class Pause(AdminBody):
    """How pausing treats requests in flight: keep them frozen, wait for them, or abort them."""

    mode: PauseMode = "keep"


class Step(AdminBody):
    """How many engine steps a held engine runs before it is held again."""

    steps: int = Field(default=1, ge=1, le=100_000, description="model steps (forward passes) to run")


class Sleep(AdminBody):
    """vLLM sleep level: 1 offloads weights and drops the KV cache, 2 drops both."""

    level: Literal[1, 2] = 1


class AbortRollout(AdminBody):
    """The rollout whose in-flight requests to abort."""

    rollout_id: str = Field(pattern=ID_PATTERN)


def _runtime(request: Request) -> ServerRuntime:
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


@router.post("/update_weights", responses=_UPDATE_ERRORS)
async def update_weights(body: UpdateWeights, request: Request) -> dict[str, Any]:
    """Load new policy weights atomically between steps (a directory inside --weights-root when that is set).

    The drafters start again; every ``in_flight`` mode but ``continue-keep-kv`` also drops the prefix cache and
    zeroes the KV cache (``continue-keep-kv`` keeps both: requests frozen mid-generation go on with the keys and
    values the old weights computed, and later requests use no block of them).
    """
    return await _runtime(request).update_weights(body.path, body.version, body.in_flight)


@router.post("/pause", responses=ADMIN_ERRORS)
async def pause(request: Request, body: Pause | None = None) -> dict[str, Any]:
    """Stop scheduling generation until /admin/resume."""
    mode = (body or Pause()).mode
    await _runtime(request).pause(mode, clear_cache=False)
    return {"paused": True, "mode": mode}


@router.post("/resume", responses=ADMIN_ERRORS)
async def resume(request: Request) -> dict[str, Any]:
    """Resume generation after /admin/pause."""
    await _runtime(request).resume()
    return {"paused": False}


@router.post("/step", responses={**ADMIN_ERRORS, 501: {"description": "this vLLM cannot step"}})
async def step(request: Request, body: Step | None = None) -> dict[str, Any]:
    """Run a held engine (after /admin/pause) a few steps and hold it again as "keep": act mid-generation at will.

    Answers once the engine is held again, after the outputs of those steps; fewer steps run when
    the requests end first.  Reproducing what happens a few tokens into a response (a weight update,
    an abort, a client hanging up) needs no race against the engine from outside.
    """
    runtime = _runtime(request)
    if not runtime.paused or runtime.sleep_level is not None:
        raise ApiError(409, "the engine is not held: POST /admin/pause first (stepping a sleeping engine is not "
                            "possible)")
    steps = (body or Step()).steps
    return {"paused": True, "steps": await runtime.run_steps(steps), "requested_steps": steps}


@router.post("/sleep", responses=ADMIN_ERRORS)
async def sleep(request: Request, body: Sleep | None = None) -> dict[str, Any]:
    """Free accelerator memory (vLLM sleep mode; start the server with --vllm sleep mode on an accelerator)."""
    level = (body or Sleep()).level
    await _runtime(request).sleep(level)
    return {"sleeping": True, "level": level}


@router.post("/wake", responses=ADMIN_ERRORS)
async def wake(request: Request) -> dict[str, Any]:
    """Restore what /admin/sleep freed."""
    await _runtime(request).wake()
    return {"sleeping": False}


@router.post("/abort_rollout", responses=ADMIN_ERRORS)
async def abort_rollout(body: AbortRollout, request: Request) -> dict[str, Any]:
    """Abort every in-flight request tagged with this rollout id (others keep running)."""
    aborted = await _runtime(request).abort_rollout(body.rollout_id)
    return {"rollout_id": body.rollout_id, "aborted_requests": aborted}


@router.post("/reset_prefix_cache", responses=ADMIN_ERRORS)
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    """Drop the engine's prefix cache."""
    done = await _runtime(request).engine.reset_prefix_cache()
    return {"reset": bool(done)}


@router.get("/status", responses=ADMIN_ERRORS)
async def status(request: Request, drafter: bool = True) -> dict[str, Any]:
    """Weight version, paused/sleeping, HTTP requests in flight, rollout scheduling, open weight uploads, drafter.

    ``paused`` and ``sleeping`` are what /admin/pause and /admin/sleep did (a weight load
    pauses while it runs; sleeping pauses too, and waking resumes), kept by the server:
    asking the engine would wait behind its output backlog on a busy machine, and its
    ``is_sleeping()`` is also true while generation is merely paused.  The drafter's counters
    come from the engine's worker process, a round trip that can take seconds while the engine is busy:
    ``?drafter=false`` leaves them out (``"drafter": null``), for polling the queue.  They are
    `ProposerStats.to_json` (``{}`` with speculation off).  ``last_weight_update`` is what the last weight
    update did and cost (`runtime.update_cost`: versions, mode, seconds generation was held, sequences
    continued and tokens recomputed; null before the first).  ``areal`` (with ``--areal-routes``, else null): whether
    AReaL's pause holds new requests, what it did to those in flight, and how many wait (`generation_gate`).
    ``weight_peers`` (null without ``--weight-peers``): the peers as last probed (every 15 s): how many answer, are
    unreachable or refuse this server's key, every version served among them and this server, and ``split``: true
    while they serve more than one (a push that committed on some servers only).  ``gc_frozen_objects``: the start-up
    objects the garbage collector skips (`heap_freeze`; 0 would mean full collections walk them all, stalling the loop).
    """
    runtime = _runtime(request)
    stats = await runtime.drafter_stats() if drafter else None
    return {"model": runtime.model_name, "weight_version": runtime.served_version,
            "paused": runtime.paused, "sleeping": runtime.sleep_level is not None,
            "sleep_level": runtime.sleep_level, "in_flight_requests": len(runtime.inflight),
            "scheduling": runtime.scheduling_status(), "weight_uploads": runtime.weight_uploads.status(),
            "queue": runtime.queue.status(), "last_weight_update": runtime.last_update,
            "areal": None if runtime.generation_gate is None else runtime.generation_gate.status(),
            "weight_peers": runtime.weight_peers.summary(runtime.served_version),
            "gc_frozen_objects": frozen_objects(),
            "drafter": None if not drafter else {} if stats is None else stats.to_json()}
