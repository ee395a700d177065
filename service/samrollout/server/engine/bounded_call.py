"""Blocking calls run in their own daemon thread and awaited with a deadline.

Weight checks read files a client named; a file on a hung network mount (or anything else
that blocks in the kernel) must not hold the server.  ``asyncio.to_thread`` would park such a
call in the loop's shared thread pool, where a few of them starve every later update and
upload, and whose threads the interpreter joins at exit, so SIGTERM could not end the
process.  `call_with_deadline` gives each call its own daemon thread instead: past the
deadline the caller gets TimeoutError at once, and the stuck thread holds nothing and never
delays shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Complete ``future`` unless its waiter already gave up (the deadline passed)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def call_with_deadline(function: Callable[..., T], *args: Any, timeout: float, name: str) -> T:
    """``function(*args)`` in a new daemon thread named ``name``; TimeoutError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = function(*args)
        except BaseException as exc:  # handed to the awaiting coroutine as it is
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown): nobody is waiting
            loop.call_soon_threadsafe(_settle, future, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wait_for(future, timeout)
