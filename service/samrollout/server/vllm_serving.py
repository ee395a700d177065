"""Every piece of vLLM's serving layer the server reuses, imported in this one place.

vLLM moves these modules between releases; this file pins the layout of vLLM 0.32
(the ``cpu`` extra, and the ``cuda`` extra's range), so following another release means
editing this file only.  What each piece does for us:

- `CompletionRequest`, `ChatCompletionRequest`: OpenAI request models (we subclass them).
- `with_cancellation`, `validate_json_request`: disconnect handling and content-type check.
- `create_error_response`, `VLLMError`: vLLM's mapping of its exceptions to OpenAI errors.
- `make_arg_parser`, `validate_parsed_serve_args`, `FlexibleArgumentParser`: vLLM's server flags.
- `init_app_state`: builds the OpenAI serving objects (completion, chat, models, renderers).
"""

from __future__ import annotations

from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation
from vllm.exceptions import VLLMError
from vllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["ChatCompletionRequest", "CompletionRequest", "FlexibleArgumentParser", "VLLMError",
           "create_error_response", "init_app_state", "make_arg_parser", "validate_json_request",
           "validate_parsed_serve_args", "with_cancellation"]
