"""Every streamed choice ends with a finish reason, even one aborted before its first token.

vLLM's streaming handlers skip a choice's chunks while it has no output yet, and an abort
(pause with abort, abort of a rollout, a dead engine) can end a choice right there: its
stream then closes with ``data: [DONE]`` and no chunk ever names that choice.  A trainer
waiting for ``finish_reason`` (to resume a partial rollout, or to count it aborted) would
see nothing.  `ChoiceEndings` adds, before the usage chunk or ``[DONE]``, one closing chunk
with ``finish_reason: "abort"`` for each choice that had none (no other ending leaves a
choice without output: a stop or length ending carries the token that ended it).
"""

from __future__ import annotations

import time
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


class ChoiceEndings:
    """Which choices of one stream finished, and the ``abort`` chunks owed to those that never did.

    Shown every event of the stream in order, once, by `rl_fields.annotate_stream`, which
    parses each event's JSON a single time for everything the server does with the stream.
    """

    def __init__(self, shape: StreamShape) -> None:
        self.shape = shape
        self.finished: set[int] = set()
        self.failed = self.closed = False
        self.header: dict[str, Any] = {"id": shape.request_id, "created": int(time.time()), "model": shape.model}

    def before(self, event: str, payload: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The closing chunks to send before ``event`` (``payload``: its JSON object, if it has one).

        Empty except once: before the usage chunk or ``[DONE]``, one per choice with no finish
        reason yet (none after an error: a stream that carried an error gets no invented ending).
        """
        if self.closed:
            return []
        if payload is not None and "error" in payload:
            self.failed = True
        elif payload is not None and payload.get("choices"):
            self.header.update({key: payload[key] for key in self.header if key in payload})
            self.finished.update(int(c.get("index", 0)) for c in payload["choices"] if c.get("finish_reason"))
        elif event.startswith("data: [DONE]") or (payload is not None and "usage" in payload):
            self.closed = True  # the last choice chunk is past: the usage chunk or the end follows
            if not self.failed:
                return [closing_chunk(self.shape, self.header, index)
                        for index in range(self.shape.choices) if index not in self.finished]
        return []


def closing_chunk(shape: StreamShape, header: dict[str, Any], index: int) -> dict[str, Any]:
    """Choice ``index``'s ``abort`` chunk, shaped as vLLM's own last chunk of that kind (``header``: id, created,
    model)."""
    choice: dict[str, Any]
    if shape.kind == "chat":
        choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}
        if shape.token_ids:
            choice["token_ids"] = []
        kind = "text_completion"
    return {"id": header["id"], "object": kind, "created": header["created"], "model": header["model"],
            "choices": [choice]}
