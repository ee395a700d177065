"""vLLM 0.32's serving layer (the ``cpu`` extra, and 0.32.x in the ``cuda`` extra's range)."""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation
from vllm.exceptions import VLLMError, VLLMValidationError
from vllm.renderers import TokenizeParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

# What create_error_response maps to an OpenAI error: vLLM's own hierarchy (client 4xx, server 5xx),
# and the raw exceptions its serving code still raises for bad input (400).
ERROR_TYPES: tuple[type[Exception], ...] = (VLLMError, ValueError, TypeError, OverflowError)

# --enable-per-request-metrics and --per-request-spec-decode-metrics exist (responses carry `metrics`).
PER_REQUEST_METRICS = True


async def set_engine_weight_version(engine: Any, version: str) -> None:
    """Tell the engine its weight version (vLLM 0.32 tracks it next to the weights)."""
    await engine.update_weight_version(version)


async def pause_engine(engine: Any, mode: str, clear_cache: bool) -> None:
    """Pause generation: in-flight requests per ``mode`` (keep, wait, abort), new requests queue until resumed."""
    await engine.pause_generation(mode=mode, clear_cache=clear_cache)


__all__ = ["ERROR_TYPES", "PER_REQUEST_METRICS", "ChatCompletionRequest", "CompletionRequest",
           "FlexibleArgumentParser", "TokenizeParams", "VLLMValidationError", "create_error_response",
           "init_app_state", "make_arg_parser", "pause_engine", "set_engine_weight_version",
           "validate_json_request", "validate_parsed_serve_args", "with_cancellation"]
