"""Requests aborted from the API side, counted as finished with ``finish_reason="abort"``.

`engine_stats` counts finished requests from the engine's per-step statistics, and vLLM hands
a request to the stat loggers only when the engine finishes it (stop, length, and the aborts
the engine makes itself, as a pause with mode "abort" does).  A request aborted through
``AsyncLLM.abort`` (a client that disconnects, ``/admin/abort_rollout``, shutdown) is dropped by
vLLM's output processor before any statistics see it.  `count_api_aborts` wraps that
processor's ``abort_requests``, which returns the requests it actually dropped (unfinished,
n > 1 children each on its own), and counts them: every request once, whatever ended it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from samrollout.metrics import definitions as m

logger = logging.getLogger("samrollout.metrics")


def count_api_aborts(engine: Any) -> None:
    """Count the requests ``engine`` (an AsyncLLM) aborts on the API side in ``requests_finished{abort}``."""
    processor: Any = getattr(engine, "output_processor", None)
    abort_requests = getattr(processor, "abort_requests", None)
    if not callable(abort_requests):
        logger.info("this engine has no output processor to watch: API-side aborts are not counted")
        return
    depth = 0  # abort_requests calls itself for the children of an n > 1 request: count the outer call only

    @functools.wraps(abort_requests)
    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        depth += 1
        try:
            aborted = abort_requests(*args, **kwargs)
        finally:
            depth -= 1
        if depth == 0 and isinstance(aborted, list) and aborted:
            m.REQUESTS_FINISHED.labels(finish_reason="abort").inc(len(aborted))
        return aborted

    processor.abort_requests = counted
