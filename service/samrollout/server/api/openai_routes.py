"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Reused from vLLM: request parsing into its protocol models, prompt rendering and chat
templates, sampling-parameter checks, generation, logprobs, streaming (its
`OpenAIServingCompletion` / `OpenAIServingChat`), and disconnect handling
(`with_cancellation`).  Written here: the RL fields (`rl_fields`), our own limits (n,
prompts per request, token ids in the vocabulary; prompt lengths in `prompt_limits`),
rollout tracking for aborts, and the weight version on every response, choice and streamed
chunk: the version that sampled the tokens, by the rule in `weight_labels` (never the version
serving when the response is written, which an update may have changed since), and on each
choice (a stream: on the chunk that ends it) its ``weight_version_spans``, which tokens each
version sampled (more than one after an update with ``in_flight: "continue"``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from samrollout.server.api.auth import require_api_key, require_api_key_or_trainer_port
from samrollout.server.api.request_life import RequestLife, StreamOutcomes, VersionLabels, outcomes_of
from samrollout.server.api.rl_fields import (
    AnyRolloutRequest,
    RolloutChatCompletionRequest,
    RolloutCompletionRequest,
    annotate_stream,
    attach_engine_args,
    rl_response_fields,
)
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.errors import ApiError, error_response
from samrollout.server.request_state.engine_ids import response_id
from samrollout.server.request_state.inflight import InflightRequest
from samrollout.server.request_state.stream_endings import ChoiceEndings, StreamShape
from samrollout.server.vllm_compat.vllm_serving import validate_json_request, with_cancellation

router = APIRouter()
_KEY = [Depends(require_api_key)]
# AReaL calls completions without a key: from the trainer's own port only (`auth`).
_KEY_OR_TRAINER = [Depends(require_api_key_or_trainer_port)]
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


async def open_runtime(request: Request) -> ServerRuntime:
    """The server runtime, once AReaL's pause lets new generation through (at once without --areal-routes); a 503
    while a level-2 sleep's discarded weights are not loaded again (`ServerRuntime.need_weights`)."""
    runtime = runtime_of(request)
    runtime.need_weights()
    if runtime.generation_gate is not None:
        await runtime.generation_gate.wait()
        runtime.need_weights()
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


def check_limits(runtime: ServerRuntime, n: int | None, token_prompts: list[list[int]], prompts: int = 1) -> None:
    """Our limits on top of vLLM's checks: n, prompts per request, and token ids inside the vocabulary."""
    settings = runtime.settings
    if n is not None and not 1 <= n <= settings.max_n:
        raise ApiError(400, f"n must be between 1 and {settings.max_n} on this server, got {n}", "n")
    if prompts > settings.max_prompts:
        raise ApiError(400, f"at most {settings.max_prompts} prompts per request on this server (--max-prompts), "
                            f"got {prompts}", "prompt")
    for tokens in token_prompts:
        bad = next((t for t in tokens if not 0 <= t < runtime.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{runtime.vocab_size - 1})", "prompt")


def _base_id(raw_request: Request, request_id: str) -> str:
    """The id vLLM's serving layer builds engine request ids from (X-Request-Id wins, as in vLLM)."""
    return raw_request.headers.get("X-Request-Id") or request_id


async def _generate(runtime: ServerRuntime, request: AnyRolloutRequest, tracked: InflightRequest,
                    call: Callable[[], Awaitable[Any]], life: RequestLife) -> Response:
    """Run vLLM's handler with rollout and in-flight tracking; add the RL fields to what it returns."""
    fields = rl_response_fields(request)
    sequences = life.sequences
    labels = life.start(tracked, request.rollout_id, request.n or 1)
    try:
        with runtime.inflight.track(tracked):
            result = await call()
    except BaseException:
        life.finish()
        raise
    if hasattr(result, "error") and hasattr(result.error, "code"):  # vLLM's ErrorResponse
        life.finish()
        return error_response(int(result.error.code), str(result.error.message), result.error.param)
    if hasattr(result, "model_dump"):
        body = result.model_dump(exclude_none=False)
        body.update(fields)
        labels.stamp(body, body=True)  # the versions that sampled its tokens, not the one serving now
        life.outcomes = lambda: outcomes_of(body)
        life.finish()
        return JSONResponse(body)
    seen = StreamOutcomes(sequences)
    life.outcomes = lambda: seen.outcomes(labels.choices(), labels.request())
    shape = StreamShape(tracked.kind, response_id(tracked.kind, tracked.base_id), request.model or runtime.model_name,
                        sequences, bool(getattr(request, "return_token_ids", False)))
    return StreamingResponse(_stream(runtime, result, ChoiceEndings(shape), tracked, fields, seen, labels, life),
                             media_type="text/event-stream")


async def _stream(runtime: ServerRuntime, chunks: AsyncIterator[str], endings: ChoiceEndings,
                  tracked: InflightRequest, fields: dict[str, Any], seen: StreamOutcomes,
                  labels: VersionLabels, life: RequestLife) -> AsyncIterator[str]:
    """vLLM's SSE stream with the RL fields, each chunk labelled with the version that sampled its tokens."""
    try:
        with runtime.inflight.track(tracked):
            async for chunk in annotate_stream(chunks, fields, seen.see, endings, labels.stamp):
                yield chunk
    finally:
        life.finish()


@router.post("/v1/completions", responses=_ERRORS,
             dependencies=[*_KEY_OR_TRAINER, Depends(validate_json_request)])
@cancellable
async def create_completion(request: RolloutCompletionRequest, raw_request: Request) -> Response:
    """OpenAI completions (text or token-id prompts, batches, n, seed, logprobs, echo, stream) with RL fields."""
    runtime = await open_runtime(raw_request)
    prompts = _prompt_count(request.prompt)
    check_limits(runtime, request.n, _prompt_token_lists(request.prompt), prompts)
    life = RequestLife(runtime, raw_request.scope, prompts * (request.n or 1))  # 429 when the queue is full
    request.limit_prompt_tokens(runtime.settings.max_prompt_tokens)
    attach_engine_args(request)
    tracked = InflightRequest(_base_id(raw_request, request.request_id), "completion", prompts, request.rollout_id)
    handler = runtime.state.openai_serving_completion
    return await _generate(runtime, request, tracked,
                           lambda: handler.create_completion(request, raw_request), life)


@router.post("/v1/chat/completions", responses=_ERRORS, dependencies=[*_KEY, Depends(validate_json_request)])
@cancellable
async def create_chat_completion(request: RolloutChatCompletionRequest, raw_request: Request) -> Response:
    """OpenAI chat completions (the tokenizer's chat template) with RL fields."""
    runtime = await open_runtime(raw_request)
    handler = runtime.state.openai_serving_chat
    if handler is None:
        raise ApiError(400, "this model has no chat template", "messages")
    check_limits(runtime, request.n, [])
    life = RequestLife(runtime, raw_request.scope, request.n or 1)  # 429 when the queue is full
    request.limit_prompt_tokens(runtime.settings.max_prompt_tokens)
    attach_engine_args(request)
    tracked = InflightRequest(_base_id(raw_request, request.request_id), "chat", 1, request.rollout_id)
    return await _generate(runtime, request, tracked,
                           lambda: handler.create_chat_completion(request, raw_request), life)


@router.get("/v1/rollouts/{rollout_id}", responses={404: {"description": "unknown rollout"}}, dependencies=_KEY)
async def rollout_summary(rollout_id: str, raw_request: Request) -> JSONResponse:
    """One rollout's summary: makespan, tail and tail share, lengths, acceptance, finish reasons."""
    summary = runtime_of(raw_request).rollouts.summary(rollout_id)
    if summary is None:
        raise ApiError(404, f"no rollout {rollout_id!r} among the recent ones", "rollout_id")
    return JSONResponse(summary)


@router.get("/v1/rollouts", dependencies=_KEY)
async def recent_rollouts(raw_request: Request) -> JSONResponse:
    """The rollout ids whose summaries are kept (most recent last)."""
    return JSONResponse({"rollouts": runtime_of(raw_request).rollouts.recent()})


@router.get("/v1/models", dependencies=_KEY)
async def list_models(raw_request: Request) -> JSONResponse:
    """The served model (OpenAI's model list), with its context length."""
    models = await runtime_of(raw_request).state.openai_serving_models.show_available_models()
    return JSONResponse(models.model_dump())
