"""The FastAPI application: lifespan (engine start and stop), routes, errors, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from samrollout.metrics.aborts import count_api_aborts
from samrollout.metrics.drafter import DRAFTER_METRICS
from samrollout.metrics.http_errors import CountHttpErrors
from samrollout.server.api import admin_routes, openai_routes, weight_upload_routes
from samrollout.server.api.auth import require_api_key
from samrollout.server.api.http_limits import BodyLimit
from samrollout.server.api.request_gate import RequestGate
from samrollout.server.areal import areal_routes
from samrollout.server.areal.generation_gate import GenerationGate
from samrollout.server.engine.engine_watch import engine_dead, exit_when_engine_dies, start_up_heartbeat
from samrollout.server.engine.heap_freeze import freeze_startup_heap
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.engine.startup import start_runtime
from samrollout.server.errors import error_response, install_error_handlers
from samrollout.server.request_state.request_end import RequestEnd
from samrollout.server.settings import ServerSettings

logger = logging.getLogger("samrollout.server")


def build_app(settings: ServerSettings) -> FastAPI:
    """The server for ``settings``; the engine starts when the app's lifespan starts (uvicorn)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with start_up_heartbeat():
            runtime = await start_runtime(settings, app.state)
        if settings.areal_routes:
            # AReaL's pause holds new requests here (a bounded number, for a bounded time)
            runtime.generation_gate = GenerationGate(settings.areal_max_held_requests, settings.areal_hold_timeout)
        count_api_aborts(runtime.engine)  # disconnects, /admin/abort_rollout: finish_reason="abort"
        app.state.runtime = runtime
        logger.info("serving %s (weights %s) with speculation %s", runtime.model_name, runtime.weight_version,
                    "on" if settings.speculation else "off")
        freeze_startup_heap()  # last of start-up: a full collection must not stall the loop (`heap_freeze`)
        background = [asyncio.create_task(_finish_idle_rollouts(runtime)),
                      asyncio.create_task(_expire_idle_uploads(runtime)),
                      asyncio.create_task(runtime.weight_peers.watch(lambda: runtime.served_version)),
                      asyncio.create_task(exit_when_engine_dies(runtime.engine, lambda: _request_exit(app)))]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await _stop(runtime)

    # The API docs list every admin route: they are served below, behind the key like /v1 and /admin (also on the
    # trainer's port, where only AReaL's routes and /v1/completions go without it: `auth`).
    app = FastAPI(title="samrollout", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None,
                  description="OpenAI-compatible rollout server with SAM speculative decoding and RL controls.")
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(RequestEnd)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, body_timeout=settings.body_timeout)
    app.add_middleware(RequestGate, settings=settings)  # Host, Origin, key, body type: before any body is read
    app.add_middleware(CountHttpErrors)
    _add_api_docs(app)
    app.include_router(openai_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(weight_upload_routes.router)
    if settings.areal_routes:
        app.include_router(areal_routes.router)
    _add_probes(app)
    return app


def _add_probes(app: FastAPI) -> None:
    """``/health`` (the engine alive) and ``/metrics`` (Prometheus), without the API key."""

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine is alive, 503 otherwise."""
        runtime: ServerRuntime | None = getattr(request.app.state, "runtime", None)
        if runtime is None:
            return error_response(503, "the engine is starting")
        try:
            await runtime.engine.check_health()
        except Exception as exc:  # the engine died: say so, keep answering
            return error_response(503, f"engine unhealthy: {exc}")
        return JSONResponse({"status": "ok", "weight_version": runtime.served_version})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus metrics (vLLM's and ours) in the text exposition format."""
        runtime: ServerRuntime | None = getattr(request.app.state, "runtime", None)
        if runtime is not None:
            DRAFTER_METRICS.update(await runtime.drafter_stats())
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _add_api_docs(app: FastAPI) -> None:
    """``/openapi.json``, ``/docs`` (Swagger UI) and ``/redoc``, which need the API key when one is set."""
    guarded = [Depends(require_api_key)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guarded)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="samrollout API")

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="samrollout API")


async def _finish_idle_rollouts(runtime: ServerRuntime, period: float = 0.5) -> None:
    """End rollouts that went idle (their histograms are observed then)."""
    while True:
        await asyncio.sleep(period)
        runtime.rollouts.finish_idle()


async def _expire_idle_uploads(runtime: ServerRuntime) -> None:
    """Delete weight uploads left idle past ``--weight-upload-idle-seconds`` (checked a few times per period)."""
    uploads = runtime.weight_uploads
    period = max(0.5, min(30.0, uploads.idle_seconds / 4))
    while True:
        await asyncio.sleep(period)
        uploads.expire()


def _request_exit(app: FastAPI) -> None:
    """The engine died: mark it, and stop serving if the launcher said how (`samrollout serve` does)."""
    app.state.engine_died = True
    stop: Callable[[], None] | None = getattr(app.state, "request_exit", None)
    if stop is not None:
        stop()


async def _stop(runtime: ServerRuntime) -> None:
    """Abort whatever is still running, then stop the engine and its worker processes."""
    try:
        ids = runtime.inflight.engine_ids()
        if ids and not engine_dead(runtime.engine):
            logger.info("shutting down: aborting %d engine requests still in flight", len(ids))
            await runtime.generation.abort(ids)
    finally:
        runtime.weight_uploads.close()
        await runtime.weight_peers.aclose()
        runtime.engine.shutdown()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("samrollout")
    except PackageNotFoundError:
        return "0+unknown"
