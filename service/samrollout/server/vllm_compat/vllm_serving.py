"""Every piece of vLLM's serving layer the server reuses, from the layout of the installed vLLM.

vLLM moves these modules between releases; `samrollout.server.vllm_compat.vllm_layouts` has one module
per supported series (0.32: the ``cpu`` and ``cuda`` extras; 0.33: the ``cuda`` extra; 0.23:
vllm-ascend 0.23) and this one picks it (`samrollout.server.vllm_compat.vllm_version`; any other vLLM
raises `UnsupportedVllmError`).
Following another release means adding a layout.  What each piece does for us:

- `CompletionRequest`, `ChatCompletionRequest`: OpenAI request models (we subclass them).
- `with_cancellation`, `validate_json_request`: disconnect handling and content-type check.
- `create_error_response`, `ERROR_TYPES`: vLLM's mapping of its exceptions to OpenAI errors.
- `make_arg_parser`, `validate_parsed_serve_args`, `FlexibleArgumentParser`: vLLM's server flags.
- `init_app_state`: builds the OpenAI serving objects (completion, chat, models, renderers).
- `PER_REQUEST_METRICS`: whether vLLM has per-request metrics (``--enable-per-request-metrics``).
- `set_engine_weight_version`: tell the engine the weight version, where it keeps one.
- `pause_engine`: pause generation, in-flight requests per mode, new requests queued (not refused).
- `TokenizeParams`, `VLLMValidationError`: the renderer's prompt-length checks, which our limits
  extend (`prompt_limits`), and the 400 they raise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from samrollout.server.vllm_compat.vllm_version import serving_series

# Types are vLLM 0.32's (what mypy checks); every layout exports the same names (their __all__).
if TYPE_CHECKING or serving_series() == "0.32":
    from samrollout.server.vllm_compat.vllm_layouts.v0_32 import *  # noqa: F403
elif serving_series() == "0.33":
    from samrollout.server.vllm_compat.vllm_layouts.v0_33 import *  # noqa: F403
else:
    from samrollout.server.vllm_compat.vllm_layouts.v0_23 import *  # noqa: F403
