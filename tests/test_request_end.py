"""What a request holds is given back once its ASGI call ends, however it ends
(`samrollout.server.request_state.request_end`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from samrollout.server.request_state.queue_limit import QueueLimit
from samrollout.server.request_state.request_end import RequestEnd, Scope, at_request_end


def _call(app: Any, scope: Scope) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(_: dict[str, Any]) -> None:
        return None

    asyncio.run(RequestEnd(app)(scope, receive, send))


def test_a_requests_callbacks_run_once_in_order_when_it_ends() -> None:
    ran: list[str] = []

    async def app(scope: Scope, *_: Any) -> None:
        at_request_end(scope, lambda: ran.append("queue hold"))
        at_request_end(scope, lambda: ran.append("labels"))

    scope: Scope = {"type": "http"}
    _call(app, scope)
    assert ran == ["queue hold", "labels"]
    _call(lambda *_: asyncio.sleep(0), scope)  # the same scope again: nothing left to run
    assert ran == ["queue hold", "labels"]


def test_a_request_that_fails_or_whose_cleanup_fails_still_gives_everything_back() -> None:
    queue, ran = QueueLimit(engine_slots=2, max_queued=0), []

    def broken() -> None:
        raise RuntimeError("cleanup bug")

    async def app(scope: Scope, *_: Any) -> None:
        queue.admit(2)
        at_request_end(scope, lambda: queue.release(2))
        at_request_end(scope, broken)
        at_request_end(scope, lambda: ran.append("after the broken one"))
        raise ConnectionResetError("the client left")

    with pytest.raises(ConnectionResetError):
        _call(app, {"type": "http"})
    assert queue.held == 0 and ran == ["after the broken one"]
