"""RL extensions of the OpenAI request and response bodies.

Requests (extra body fields, next to OpenAI's): ``rollout_id`` tags a request as part of
one rollout (metrics follow it; ``/admin/abort_rollout`` aborts it); ``group_id`` makes
requests siblings that draft from one shared automaton (the ``n`` children of one request
already are).  ``return_token_ids`` defaults to true here, so each choice carries
``token_ids`` and ``prompt_token_ids`` (unless ``echo`` is set: then the prompt comes back as text).

Responses: ``weight_version`` (the weights that produced its tokens, by the rule in
`weight_labels`: on the body, on each choice, on every streamed chunk), and ``rollout_id`` /
``group_id`` echoed back.  vLLM's own fields are untouched.

The request models also hand our prompt limits to vLLM's tokenization (`prompt_limits`):
vLLM asks the request for its `TokenizeParams`, and ours add to vLLM's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import Field, PrivateAttr

from samrollout.config import GROUP_FIELD, ROLLOUT_FIELD
from samrollout.server.api.prompt_limits import PromptLimits, with_prompt_limits
from samrollout.server.request_state.stream_endings import ChoiceEndings
from samrollout.server.vllm_compat.vllm_serving import ChatCompletionRequest, CompletionRequest

ID_PATTERN = r"^[A-Za-z0-9._:/@+=-]{1,128}$"
MAX_LENGTH_PENALTY = 10.0
"""Beam search's ``length_penalty`` is held to [-10, 10]: vLLM divides by ``length ** length_penalty``, which a
penalty of a few hundred rounds to 0 (a ZeroDivisionError, a 500); useful values are near 1."""


def _length_penalty() -> Any:
    return Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False,
                 description="beam search's length penalty, within [-10, 10] (MAX_LENGTH_PENALTY)")


class RolloutCompletionRequest(CompletionRequest):
    """OpenAI completion request plus the RL fields; token ids returned by default; our prompt limits."""

    rollout_id: str | None = Field(None, pattern=ID_PATTERN, description="rollout this request belongs to")
    group_id: str | None = Field(None, pattern=ID_PATTERN, description="requests with one group id are siblings")
    return_token_ids: bool | None = Field(True, description="return prompt and generated token ids in each choice")
    length_penalty: float = _length_penalty()
    _max_prompt_tokens: int | None = PrivateAttr(None)

    def limit_prompt_tokens(self, limit: int | None) -> None:
        """Cap the prompt at ``limit`` tokens (the server's --max-prompt-tokens; None: the context)."""
        self._max_prompt_tokens = limit

    def build_tok_params(self, model_config: Any) -> PromptLimits:
        """vLLM's prompt checks plus ours: prompt + max_tokens within the context, the prompt-length cap."""
        return with_prompt_limits(super().build_tok_params(model_config), self._max_prompt_tokens, "prompt")


class RolloutChatCompletionRequest(ChatCompletionRequest):
    """OpenAI chat completion request plus the RL fields; token ids returned by default; our prompt limits."""

    rollout_id: str | None = Field(None, pattern=ID_PATTERN, description="rollout this request belongs to")
    group_id: str | None = Field(None, pattern=ID_PATTERN, description="requests with one group id are siblings")
    return_token_ids: bool | None = Field(True, description="return prompt and generated token ids in each choice")
    length_penalty: float = _length_penalty()
    _max_prompt_tokens: int | None = PrivateAttr(None)

    def limit_prompt_tokens(self, limit: int | None) -> None:
        """Cap the rendered prompt at ``limit`` tokens (the server's --max-prompt-tokens; None: the context)."""
        self._max_prompt_tokens = limit

    def build_tok_params(self, model_config: Any) -> PromptLimits:
        """vLLM's prompt checks plus ours: prompt + max_tokens within the context, the prompt-length cap."""
        return with_prompt_limits(super().build_tok_params(model_config), self._max_prompt_tokens, "messages")


AnyRolloutRequest = RolloutCompletionRequest | RolloutChatCompletionRequest


def attach_engine_args(request: AnyRolloutRequest) -> None:
    """Carry the group and rollout ids to the engine in ``SamplingParams.extra_args`` (vLLM's vllm_xargs).

    ``echo`` without an explicit ``return_token_ids`` turns the token ids off: vLLM leaves
    the echoed prompt text empty when it returns token ids, and OpenAI clients expect it.
    """
    if request.echo and "return_token_ids" not in request.model_fields_set:
        request.return_token_ids = False
    extra: dict[str, Any] = dict(request.vllm_xargs or {})
    if request.group_id is not None:
        extra[GROUP_FIELD] = request.group_id
    if request.rollout_id is not None:
        extra[ROLLOUT_FIELD] = request.rollout_id
    request.vllm_xargs = extra or None


def rl_response_fields(request: AnyRolloutRequest) -> dict[str, Any]:
    """The request's RL ids, echoed in every response body and streamed chunk."""
    return {"rollout_id": request.rollout_id, "group_id": request.group_id}


Stamp = Callable[[dict[str, Any]], None]


async def annotate_stream(chunks: AsyncIterator[str], fields: dict[str, Any],
                          see: Callable[[dict[str, Any]], None] | None = None,
                          endings: ChoiceEndings | None = None, stamp: Stamp | None = None) -> AsyncIterator[str]:
    """Add ``fields`` to each ``data: {...}`` event of vLLM's SSE stream (showing each to ``see``, then letting
    ``stamp`` add what depends on the chunk, e.g. its weight version), and insert the closing chunks ``endings``
    owes to choices that never finished: one JSON parse per event for all of it."""
    async for chunk in chunks:
        yield _annotate_events(chunk, fields, see, endings, stamp)


def _annotate_events(chunk: str, fields: dict[str, Any], see: Callable[[dict[str, Any]], None] | None,
                     endings: ChoiceEndings | None, stamp: Stamp | None = None) -> str:
    out: list[str] = []
    for event in chunk.split("\n\n"):
        payload: dict[str, Any] | None = None
        if event.startswith("data: {"):
            try:
                payload = json.loads(event[len("data: "):])
            except json.JSONDecodeError:
                payload = None  # passed on as vLLM sent it
        if endings is not None:
            out.extend(_annotated(closing, fields, see, stamp) for closing in endings.before(event, payload))
        if payload is not None and "error" not in payload:
            event = _annotated(payload, fields, see, stamp)
        out.append(event)
    return "\n\n".join(out)


def _annotated(payload: dict[str, Any], fields: dict[str, Any], see: Callable[[dict[str, Any]], None] | None,
               stamp: Stamp | None = None) -> str:
    """One chunk as the client gets it: shown to ``see``, with ``fields`` added and ``stamp``ed, as SSE ``data:``."""
    if see is not None:
        see(payload)
    payload.update(fields)
    if stamp is not None:
        stamp(payload)
    return "data: " + json.dumps(payload, separators=(",", ":"))
