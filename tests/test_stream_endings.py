"""The stream pass that gives every streamed choice a finish reason (vLLM skips choices with no output)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from samrollout.server.api.rl_fields import annotate_stream
from samrollout.server.request_state.stream_endings import ChoiceEndings, StreamShape

COMPLETION = StreamShape("completion", "cmpl-base", "tiny", choices=2, token_ids=True)


def event(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body) + "\n\n"


def choice(index: int, finish: str | None, text: str = "x") -> dict[str, Any]:
    return {"id": "cmpl-real", "object": "text_completion", "created": 7, "model": "tiny",
            "choices": [{"index": index, "text": text, "finish_reason": finish}]}


def through(chunks: list[str], shape: StreamShape = COMPLETION, fields: dict[str, Any] | None = None,
            seen: list[dict[str, Any]] | None = None) -> list[dict[str, Any] | str]:
    """The events a client gets from the server's stream pass over vLLM's ``chunks``."""
    async def source() -> AsyncIterator[str]:
        for chunk in chunks:
            yield chunk

    async def collect() -> str:
        see = seen.append if seen is not None else None
        return "".join([c async for c in annotate_stream(source(), fields or {}, see, ChoiceEndings(shape))])

    events = [e for e in asyncio.run(collect()).split("\n\n") if e]
    return [json.loads(e[6:]) if e.startswith("data: {") else e for e in events]


def test_a_choice_aborted_before_its_first_token_gets_an_abort_chunk_before_done() -> None:
    out = through([event(choice(0, None)), event(choice(0, "abort")), "data: [DONE]\n\n"])
    assert out[-1] == "data: [DONE]"
    closing = out[-2]
    assert isinstance(closing, dict)
    assert closing["choices"] == [{"index": 1, "text": "", "logprobs": None, "finish_reason": "abort",
                                   "token_ids": []}]
    assert (closing["id"], closing["model"], closing["created"]) == ("cmpl-real", "tiny", 7)  # copied from vLLM's


def test_a_stream_with_no_chunk_at_all_still_names_every_choice() -> None:
    out = through(["data: [DONE]\n\n"])
    assert [c["choices"][0]["index"] for c in out[:-1] if isinstance(c, dict)] == [0, 1]
    assert all(isinstance(c, dict) and c["id"] == "cmpl-base" for c in out[:-1])


def test_closing_chunks_come_before_the_usage_chunk() -> None:
    usage = {"id": "cmpl-real", "object": "text_completion", "created": 7, "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    out = through([event(choice(0, "length")) + event(usage) + "data: [DONE]\n\n"])
    assert [c["choices"][0]["index"] if isinstance(c, dict) and c["choices"] else c for c in out] == [
        0, 1, out[2], "data: [DONE]"]
    assert isinstance(out[2], dict) and "usage" in out[2]


def test_streams_whose_choices_all_finished_pass_through_unchanged() -> None:
    chunks = [event(choice(0, "length")), event(choice(1, "stop")), "data: [DONE]\n\n"]
    assert through(chunks) == through(chunks, StreamShape("completion", "x", "y", choices=0))
    assert len(through(chunks)) == 3


def test_a_stream_that_ended_in_an_error_gets_no_invented_ending() -> None:
    out = through([event({"error": {"message": "engine died", "code": 500}}), "data: [DONE]\n\n"])
    assert len(out) == 2


def test_chat_streams_close_with_an_empty_delta() -> None:
    shape = StreamShape("chat", "chatcmpl-base", "tiny", choices=1)
    out = through(["data: [DONE]\n\n"], shape)
    closing = out[0]
    assert isinstance(closing, dict) and closing["object"] == "chat.completion.chunk"
    assert closing["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort"}]


def test_closing_chunks_carry_the_rl_fields_and_count_as_the_choices_ending() -> None:
    seen: list[dict[str, Any]] = []
    out = through([event(choice(0, "stop")), "data: [DONE]\n\n"], fields={"rollout_id": "r1", "group_id": "g"},
                  seen=seen)
    closing = out[1]
    assert isinstance(closing, dict) and closing["choices"][0]["finish_reason"] == "abort"
    assert (closing["rollout_id"], closing["group_id"]) == ("r1", "g")
    assert [c["choices"][0]["finish_reason"] for c in seen] == ["stop", "abort"]  # what the rollout summary counts
