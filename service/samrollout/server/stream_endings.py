"""Every streamed choice ends with a finish reason, even one aborted before its first token.

vLLM's streaming handlers skip a choice's chunks while it has no output yet, and an abort
(pause with abort, abort of a rollout, a dead engine) can end a choice right there: its
stream then closes with ``data: [DONE]`` and no chunk ever names that choice.  A trainer
waiting for ``finish_reason`` (to resume a partial rollout, or to count it aborted) would
see nothing.  This wrapper adds, before the usage chunk or ``[DONE]``, one closing chunk
with ``finish_reason: "abort"`` for each choice that had none (no other ending leaves a
choice without output: a stop or length ending carries the token that ended it).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamShape:
    """What a closing chunk needs: the stream's kind (``completion`` or ``chat``), choice count, and the id and
    model to use when vLLM sent no chunk to copy them from."""

    kind: str
    request_id: str
    model: str
    choices: int
    token_ids: bool = False  # the request asked for token ids (completions' ``return_token_ids``)


async def close_unfinished_choices(chunks: AsyncIterator[str], shape: StreamShape) -> AsyncIterator[str]:
    """Pass vLLM's SSE ``chunks`` through, adding an ``abort`` chunk for each choice that never finished."""
    finished: set[int] = set()
    failed = closed = False
    header: dict[str, Any] = {"id": shape.request_id, "created": int(time.time()), "model": shape.model}
    async for chunk in chunks:
        if closed:
            yield chunk
            continue
        events = chunk.split("\n\n")
        for position, event in enumerate(events):
            payload = _payload(event)
            if payload is not None and "error" in payload:
                failed = True
            elif payload is not None and payload.get("choices"):
                header.update({key: payload[key] for key in header if key in payload})
                finished.update(int(c.get("index", 0)) for c in payload["choices"] if c.get("finish_reason"))
            elif event.startswith("data: [DONE]") or (payload is not None and "usage" in payload):
                closed = True  # the last choice chunk is past: the usage chunk or the end follows
                missing = [] if failed else [i for i in range(shape.choices) if i not in finished]
                if missing:
                    before = "\n\n".join(events[:position])
                    after = "\n\n".join(events[position:])
                    yield (before + "\n\n" if before else "") + _closing_events(shape, header, missing) + after
                    break
        else:
            yield chunk


def _payload(event: str) -> dict[str, Any] | None:
    if not event.startswith("data: {"):
        return None
    try:
        payload = json.loads(event[len("data: "):])
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def _closing_events(shape: StreamShape, header: dict[str, Any], indices: list[int]) -> str:
    """One SSE event per choice index, shaped as vLLM's own last chunk of that kind (``header``: id, created, model)."""
    events = []
    for index in indices:
        choice: dict[str, Any]
        if shape.kind == "chat":
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}
            if shape.token_ids:
                choice["token_ids"] = []
            kind = "text_completion"
        body = {"id": header["id"], "object": kind, "created": header["created"], "model": header["model"],
                "choices": [choice]}
        events.append("data: " + json.dumps(body, separators=(",", ":")) + "\n\n")
    return "".join(events)
