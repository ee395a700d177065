"""Watching the engine from the API process: progress while it starts, and an exit when it dies.

- Start-up: vLLM's engine start blocks the event loop (loading, memory profiling, warm-up,
  torch compile where on) and says little for minutes; a thread prints what is going on
  every `HEARTBEAT_SECONDS` so that a slow first start does not read like a hang.
- Death: an engine whose core or worker died never recovers; a server that kept listening
  would answer 500/503 forever.  `exit_when_engine_dies` notices within a second or two,
  logs the cause and asks uvicorn to stop, and `samrollout serve` then exits with
  `ENGINE_DIED_EXIT_CODE`, so a supervisor (compose ``restart:``, Kubernetes) starts a
  fresh one, as plain ``vllm serve`` does.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger("samrollout.server")
HEARTBEAT_SECONDS = 15.0
ENGINE_DIED_EXIT_CODE = 4
STARTING_HINT = ("preparing the model, loading weights, measuring memory, warming up; "
                 "30-60 s on a 2-core CPU in eager mode, minutes on a first start with --compile")


@contextmanager
def start_up_heartbeat(every: float = HEARTBEAT_SECONDS, hint: str = STARTING_HINT) -> Iterator[None]:
    """Print a line to stderr every ``every`` seconds while the block (the engine start) runs."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            print(f"samrollout: engine still starting, {time.monotonic() - started:.0f} s so far ({hint})",
                  file=sys.stderr, flush=True)

    thread = threading.Thread(target=beat, name="samrollout-start-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        print(f"samrollout: engine ready after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def engine_dead(engine: Any) -> bool:
    """Whether vLLM marked the engine dead (its core process or a worker failed)."""
    return bool(engine.errored)


async def exit_when_engine_dies(engine: Any, request_exit: Callable[[], None], period: float = 1.0) -> None:
    """Poll the engine; when it is dead, log the cause and call ``request_exit`` (then return)."""
    while not engine_dead(engine):
        await asyncio.sleep(period)
    cause = getattr(engine, "dead_error", None)
    logger.critical("the engine died (%s); stopping the server so that its supervisor restarts it (exit code %d)",
                    cause, ENGINE_DIED_EXIT_CODE)
    request_exit()
