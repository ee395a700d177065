"""AReaL's inference-server routes, served under its names (``--areal-routes``), so that AReaL drives samrollout.

AReaL (1.0.x) reaches vLLM through its ``RemotevLLMEngine`` and its own vLLM server extension;
the engine class is fixed in AReaL's code (no configuration chooses another), so samrollout
answers the routes that engine calls:

- ``POST /areal_pause_generation`` closes the generation gate (`generation_gate`): new requests
  wait until continue.  Requests in flight are aborted and return their tokens so far with
  ``finish_reason: "abort"`` (what AReaL's own server does; AReaL sends them again with those
  tokens appended), or, with ``{"in_flight": "continue"}`` (what `samrollout_client.areal`
  sends), frozen, to go on under the next weights within the same response.
- ``POST /areal_update_weights`` ``{"model_path"}``: load the checkpoint AReaL saved
  (`ServerRuntime.load_weights`, same checks as ``/admin/update_weights``), as version ``N``
  when the directory is AReaL's ``weight_update_vN`` (AReaL sends no version).  In-flight
  requests frozen by a "continue" pause go on under the new weights; any others are aborted.
  The gate stays closed: the engine runs again, new requests wait for continue.
- ``POST /areal_continue_generation``: the engine runs (once a weight load under way has ended: the update lock),
  the gate opens.
- ``POST /sleep``, ``POST /wake_up``: vLLM's sleep mode (AReaL's offload and onload); after ``?level=2`` the
  weights are discarded and generation is refused (503) until a load, wake or not (`ServerRuntime.sleep`).
- The NCCL routes (``/areal_init_weights_update_group``, ``/areal_set_update_weight_meta``,
  ``/areal_update_weights_xccl`` and their LoRA forms): 501, naming ``actor.weight_update_mode=disk``;
  ``/areal_update_weights_lora``: 501 (no LoRA adapters).

Replies carry AReaL's ``{"success", "message"}``; errors are OpenAI-style with their 4xx code, as
everywhere (AReaL reads only the status).  AReaL sends no API key: these routes (and
``/v1/completions``) answer without one on the trainer's own port (``--areal-port``, `auth`); on
``--port`` they need the key like ``/v1`` when the server has one.  ``model_path`` must lie inside
``--weights-root`` (403 otherwise), which ``--areal-routes`` requires unless told not to.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from samrollout.server.api.auth import require_api_key_or_trainer_port
from samrollout.server.areal.generation_gate import AReaLPause, GenerationGate
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.errors import ApiError
from samrollout.server.weights.update_modes import update_mode
from samrollout.server.weights.weights_root import check_path_limits
from samrollout_client.protocol.areal_checkpoints import areal_version
from samrollout_client.protocol.modes import InFlight

router = APIRouter(dependencies=[Depends(require_api_key_or_trainer_port)], tags=["AReaL"])
_ERRORS: dict[int | str, dict[str, Any]] = {400: {"description": "bad request"},
                                            403: {"description": "model_path is outside --weights-root"},
                                            409: {"description": "not possible in this state or configuration"}}
NCCL_HELP = ("samrollout loads weights from a directory or from an HTTP push, not over NCCL: set "
             "actor.weight_update_mode=disk in AReaL's config")
LORA_HELP = "samrollout serves full weights only, not LoRA adapters: set actor.use_lora=false in AReaL's config"


class AReaLBody(BaseModel):
    """A body AReaL sends: fields this server does not know are ignored, as AReaL's own server does."""

    model_config = ConfigDict(extra="ignore")


class PauseGeneration(AReaLBody):
    """What pausing does to the requests in flight (AReaL sends ``{}``: abort them)."""

    in_flight: AReaLPause = Field(default="abort", description="abort them, returning their tokens so far, or "
                                  "freeze them to continue under the next weights in the same response")


class UpdateWeights(AReaLBody):
    """The checkpoint directory AReaL saved (``.../weight_update_vN``)."""

    model_path: str = Field(min_length=1, description="directory with the new *.safetensors")
    load_format: Literal["auto", "safetensors"] = Field("auto", description="only safetensors files are read")
    abort_all_requests: bool = Field(False, description="abort the requests in flight even after a continue pause")


def _runtime(request: Request) -> tuple[ServerRuntime, GenerationGate]:
    runtime: ServerRuntime = request.app.state.runtime
    if not isinstance(runtime.generation_gate, GenerationGate):  # mounted only with --areal-routes: never reached
        raise ApiError(409, "AReaL's routes are off: start the server with --areal-routes")
    return runtime, runtime.generation_gate


def _done(message: str, **fields: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **fields}


@router.post("/areal_pause_generation", responses=_ERRORS)
async def pause_generation(request: Request, body: PauseGeneration | None = None) -> dict[str, Any]:
    """Hold new requests until continue; abort (default) or freeze the requests in flight."""
    runtime, gate = _runtime(request)
    in_flight = (body or PauseGeneration()).in_flight
    gate.close(in_flight)
    if runtime.sleep_level is None:
        await runtime.pause(update_mode(in_flight).pause, clear_cache=False)
    return _done(f"generation paused (requests in flight: {in_flight})", in_flight=in_flight)


@router.post("/areal_continue_generation", responses=_ERRORS)
async def continue_generation(request: Request) -> dict[str, Any]:
    """Run the engine again and let waiting requests through."""
    runtime, gate = _runtime(request)
    await runtime.resume_unless_sleeping()  # under the update lock: never while a load swaps the weights
    gate.open()
    return _done("generation continued")


@router.post("/areal_update_weights", responses=_ERRORS)
async def update_weights(body: UpdateWeights, request: Request) -> dict[str, Any]:
    """Load AReaL's saved checkpoint as version N; frozen requests go on under it, the gate stays as it is."""
    runtime, gate = _runtime(request)
    keep_going = gate.closed and gate.pause == "continue" and not body.abort_all_requests
    in_flight: InFlight = "continue" if keep_going else "abort"
    check_path_limits(body.model_path, "model_path")  # before any work on it (weights_root)
    version = areal_version(body.model_path)
    cost = await runtime.update_weights(body.model_path, version, in_flight, param="model_path")
    return _done(f"weights {version} loaded from {body.model_path}", **cost)


@router.post("/sleep", responses=_ERRORS)
async def sleep(request: Request, level: Annotated[int, Query(ge=1, le=2, description=(
        "1 offloads the weights, 2 discards them (generation is refused until a load)"))] = 1) -> dict[str, Any]:
    """Free accelerator memory (AReaL's offload): vLLM sleep mode, as ``/admin/sleep``."""
    runtime, _ = _runtime(request)
    await runtime.sleep(level)
    return _done(f"sleeping at level {level}")


@router.post("/wake_up", responses=_ERRORS)
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
    """Restore what /sleep freed (AReaL's onload), all of it or the ``tags`` named (weights, kv_cache)."""
    runtime, _ = _runtime(request)
    await runtime.wake(tags)
    return _done("awake" if runtime.sleep_level is None else f"restored {', '.join(tags or [])}")


def _refusal(message: str) -> Any:
    """A route that answers 501 with ``message``: AReaL sees at once why, instead of a 404 it would retry."""

    async def refuse() -> None:
        raise ApiError(501, message)

    return refuse


for _path, _why in (*((p, NCCL_HELP) for p in ("/areal_init_weights_update_group", "/areal_set_update_weight_meta",
                                               "/areal_update_weights_xccl", "/areal_set_update_weight_meta_lora",
                                               "/areal_update_weights_lora_xccl")),
                    ("/areal_update_weights_lora", LORA_HELP)):
    router.add_api_route(_path, _refusal(_why), methods=["POST"], responses={501: {"description": _why}},
                         summary=f"not served: {_why}")
