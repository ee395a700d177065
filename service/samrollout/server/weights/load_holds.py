"""Testing only: hold a weight load at a named point while a flag file exists, to reproduce a slow check or load.

Set ``SAMROLLOUT_TEST_HOLD_DIR`` in the server's environment (never in production): while
``<dir>/hold-check`` exists, every weight load waits before checking its files (a slow disk: the
commit outlives its client's timeout); while ``<dir>/hold-swap`` exists, it waits inside the swap,
with generation held and the update lock taken (what runs meanwhile must not step the engine).
Unset, `hold_at` returns at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

HOLD_DIR_ENV = "SAMROLLOUT_TEST_HOLD_DIR"
POLL_S = 0.05
logger = logging.getLogger("samrollout.server")


async def hold_at(point: str) -> None:
    """Wait while ``<SAMROLLOUT_TEST_HOLD_DIR>/hold-<point>`` exists (at once when the variable is unset)."""
    folder = os.environ.get(HOLD_DIR_ENV)
    if not folder:
        return
    flag = Path(folder) / f"hold-{point}"
    if flag.exists():
        logger.warning("weight load held at %s while %s exists (%s; testing only)", point, flag, HOLD_DIR_ENV)
    while flag.exists():
        await asyncio.sleep(POLL_S)
