"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Reused from vLLM: request parsing into its protocol models, prompt rendering and chat
templates, sampling-parameter checks, generation, logprobs, streaming (its
`OpenAIServingCompletion` / `OpenAIServingChat`), and disconnect handling
(`with_cancellation`).  Written here: the RL fields (`rl_fields`), our own limits (n,
token ids in the vocabulary), rollout tracking for aborts, and the weight version on
every response.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from samrollout.server.auth import require_api_key
from samrollout.server.errors import ApiError, error_response
from samrollout.server.inflight import InflightRequest
from samrollout.server.rl_fields import (
    RolloutChatCompletionRequest,
    RolloutCompletionRequest,
    annotate_stream,
    attach_engine_args,
    rl_response_fields,
)
from samrollout.server.runtime import ServerRuntime
from samrollout.server.vllm_serving import validate_json_request, with_cancellation

router = APIRouter(dependencies=[Depends(require_api_key)])
_ERRORS: dict[int | str, dict[str, Any]] = {400: {"description": "bad request (OpenAI-style error)"},
                                            401: {"description": "missing or wrong API key"},
                                            404: {"description": "unknown model"}}


_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Response]])


def cancellable(handler: _Handler) -> _Handler:
    """vLLM's `with_cancellation`: a client that hangs up cancels the handler, which aborts its engine requests."""
    return cast(_Handler, with_cancellation(handler))  # type: ignore[no-untyped-call]


def runtime_of(request: Request) -> ServerRuntime:
    """The server runtime (set up by the app's lifespan)."""
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


def _prompt_token_lists(prompt: Any) -> list[list[int]]:
    """Token-id prompts in a completion request (text prompts are tokenized by vLLM)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list):
        return [p for p in prompt if isinstance(p, list)]
    return []


def _prompt_count(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


def check_limits(runtime: ServerRuntime, n: int | None, token_prompts: list[list[int]]) -> None:
    """Our limits on top of vLLM's checks: n, and token ids inside the vocabulary."""
    if n is not None and not 1 <= n <= runtime.settings.max_n:
        raise ApiError(400, f"n must be between 1 and {runtime.settings.max_n} on this server, got {n}", "n")
    for tokens in token_prompts:
        bad = next((t for t in tokens if not 0 <= t < runtime.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{runtime.vocab_size - 1})", "prompt")


def _base_id(raw_request: Request, request_id: str) -> str:
    """The id vLLM's serving layer builds engine request ids from (X-Request-Id wins, as in vLLM)."""
    return raw_request.headers.get("X-Request-Id") or request_id


async def _respond(runtime: ServerRuntime, result: Any, tracked: InflightRequest,
                   fields: dict[str, Any]) -> Response:
    """Turn vLLM's result (error, response or SSE generator) into our response."""
    if hasattr(result, "error") and hasattr(result.error, "code"):  # vLLM's ErrorResponse
        return error_response(int(result.error.code), str(result.error.message), result.error.param)
    if hasattr(result, "model_dump"):
        body = result.model_dump(exclude_none=False)
        body.update(fields)
        body["weight_version"] = runtime.weight_version  # the version that finished it
        return JSONResponse(body)

    async def stream() -> AsyncIterator[str]:
        with runtime.inflight.track(tracked):
            async for chunk in annotate_stream(result, {**fields, "weight_version": runtime.weight_version}):
                yield chunk

    return StreamingResponse(stream(), media_type="text/event-stream")


@router.post("/v1/completions", responses=_ERRORS, dependencies=[Depends(validate_json_request)])
@cancellable
async def create_completion(request: RolloutCompletionRequest, raw_request: Request) -> Response:
    """OpenAI completions (text or token-id prompts, batches, n, seed, logprobs, echo, stream) with RL fields."""
    runtime = runtime_of(raw_request)
    handler = runtime.state.openai_serving_completion
    check_limits(runtime, request.n, _prompt_token_lists(request.prompt))
    attach_engine_args(request)
    tracked = InflightRequest(_base_id(raw_request, request.request_id), "completion",
                              _prompt_count(request.prompt), request.rollout_id)
    fields = rl_response_fields(request)
    with runtime.inflight.track(tracked):
        result = await handler.create_completion(request, raw_request)
        if not request.stream:
            return await _respond(runtime, result, tracked, fields)
    return await _respond(runtime, result, tracked, fields)


@router.post("/v1/chat/completions", responses=_ERRORS, dependencies=[Depends(validate_json_request)])
@cancellable
async def create_chat_completion(request: RolloutChatCompletionRequest, raw_request: Request) -> Response:
    """OpenAI chat completions (the tokenizer's chat template) with RL fields."""
    runtime = runtime_of(raw_request)
    handler = runtime.state.openai_serving_chat
    if handler is None:
        raise ApiError(400, "this model has no chat template", "messages")
    check_limits(runtime, request.n, [])
    attach_engine_args(request)
    tracked = InflightRequest(_base_id(raw_request, request.request_id), "chat", 1, request.rollout_id)
    fields = rl_response_fields(request)
    with runtime.inflight.track(tracked):
        result = await handler.create_chat_completion(request, raw_request)
        if not request.stream:
            return await _respond(runtime, result, tracked, fields)
    return await _respond(runtime, result, tracked, fields)


@router.get("/v1/models")
async def list_models(raw_request: Request) -> JSONResponse:
    """The served model (OpenAI's model list), with its context length."""
    models = await runtime_of(raw_request).state.openai_serving_models.show_available_models()
    return JSONResponse(models.model_dump())
