"""vLLM 0.23's serving layer (the vLLM that vllm-ascend 0.23.0 and 0.23.0.post1 run on).

Where it differs from 0.32: the app-state factory lives in the OpenAI api_server module
and the server flags in ``openai/cli_args``; the error mapping is in ``serve/utils``; there
is no ``VLLMError`` hierarchy (its errors are ``VLLMValidationError``, a ValueError,
``VLLMNotFoundError`` and ``GenerationError``); the engine keeps no weight version; and there
are no per-request metrics flags.  tests/test_vllm023_serving_contract.py checks all of it
against vLLM 0.23.0's released source.
"""

from __future__ import annotations

from typing import Any

# mypy checks against vLLM 0.32, where most of these modules do not exist: their names are Any there.
from vllm.entrypoints.openai.api_server import init_app_state
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.engine.protocol import GenerationError
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation
from vllm.entrypoints.serve.utils.error_response import create_error_response
from vllm.exceptions import VLLMNotFoundError, VLLMValidationError
from vllm.renderers import TokenizeParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

# What create_error_response maps to an OpenAI error: not-found (404), generation errors (their status),
# and bad input, ValueError (VLLMValidationError is one), TypeError, OverflowError (400).
ERROR_TYPES: tuple[type[Exception], ...] = (VLLMNotFoundError, GenerationError, ValueError, TypeError,
                                            OverflowError)

# vLLM 0.23's parser has neither --enable-per-request-metrics nor --per-request-spec-decode-metrics.
PER_REQUEST_METRICS = False


async def set_engine_weight_version(engine: Any, version: str) -> None:
    """Nothing to do: vLLM 0.23's engine keeps no weight version (the server reports its own)."""


async def pause_engine(engine: Any, mode: str, clear_cache: bool) -> None:
    """Pause generation: in-flight requests per ``mode`` (keep, wait, abort), new requests queue until resumed."""
    await engine.pause_generation(mode=mode, clear_cache=clear_cache)


__all__ = ["ERROR_TYPES", "PER_REQUEST_METRICS", "ChatCompletionRequest", "CompletionRequest",
           "FlexibleArgumentParser", "TokenizeParams", "VLLMValidationError", "create_error_response",
           "init_app_state", "make_arg_parser", "pause_engine", "set_engine_weight_version",
           "validate_json_request", "validate_parsed_serve_args", "with_cancellation"]
