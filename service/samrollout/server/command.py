"""``samrollout serve``: start the rollout server (built-in model, SAM and the static threshold by default)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from typing import Any

from pydantic import ValidationError

from samrollout.server.engine.engine_watch import ENGINE_DIED_EXIT_CODE
from samrollout.server.settings import add_settings_flags, settings_from_args
from samrollout.server.vllm_compat.vllm_version import UnsupportedVllmError, serving_series
from samrollout.server.weights.staging_dir import StagingDirError, private_staging_root
from samrollout.server.weights.weight_uploads import staging_root

STARTUP_FAILED_EXIT_CODE = 3  # as uvicorn: the engine or the app could not start
KEY_ON_COMMAND_LINE = ("samrollout serve: warning: --api-key on the command line shows in `ps` (and /proc) to every "
                       "user of this machine: give --api-key-file FILE (SAMROLLOUT_API_KEY_FILE) or set "
                       "SAMROLLOUT_API_KEY instead")


def add_serve_parser(commands: Any) -> None:
    """Register ``serve`` on the top-level parser's sub-commands."""
    parser = commands.add_parser("serve", help="start the OpenAI-compatible rollout server",
                                 description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_settings_flags(parser)
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Validate the settings, then run uvicorn until SIGINT/SIGTERM (graceful: in-flight requests drain)."""
    if hasattr(args, "api_key"):  # given as a flag, not through the environment
        print(KEY_ON_COMMAND_LINE, file=sys.stderr, flush=True)
    try:
        settings = settings_from_args(args)
        settings.speculation_config("cpu")  # checks them (any device: the engine's own applies at start)
    except (ValidationError, ValueError) as exc:
        print(f"samrollout serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    try:  # before vLLM is imported: a staging root another user could write to stops the start at once
        private_staging_root(staging_root(settings.weight_staging_dir))
    except (StagingDirError, OSError) as exc:
        print(f"samrollout serve: {exc}", file=sys.stderr)
        return 2
    try:
        serving_series()
    except UnsupportedVllmError as exc:
        print(f"samrollout serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from samrollout.server.app import build_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_app(settings)
    trainer = f", AReaL's trainer on port {settings.areal_port}" if settings.areal_port else ""
    print(f"samrollout: starting on http://{settings.host}:{settings.port}{trainer} (engine start takes a while)",
          file=sys.stderr, flush=True)
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal to the handler
    # installed before it: a no-op one makes a drained shutdown exit with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from samrollout.server.api.http_limits import connection_budgets, guarded_http_protocol

    budgets = connection_budgets(settings.max_connections, settings.areal_port, settings.trainer_max_connections)
    protocol = guarded_http_protocol(AutoHTTPProtocol, budgets, settings.header_timeout)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout), http=protocol,
                            timeout_keep_alive=settings.keep_alive_timeout)
    server = uvicorn.Server(config)
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run(sockets=listeners(config, settings.areal_port))
    if getattr(app.state, "engine_died", False):
        return ENGINE_DIED_EXIT_CODE
    return 0 if server.started else STARTUP_FAILED_EXIT_CODE


def listeners(config: Any, areal_port: int | None) -> list[socket.socket]:
    """The bound sockets the server accepts on: ``--port``, and the trainer's own ``--areal-port`` (`auth`) if set.

    Both are bound before the engine starts, as uvicorn binds one: a port taken stops the start.
    """
    import uvicorn

    sockets = [config.bind_socket()]
    if areal_port is not None:
        trainer = uvicorn.Config(config.app, host=config.host, port=areal_port)
        sockets.append(trainer.bind_socket())
    return sockets
