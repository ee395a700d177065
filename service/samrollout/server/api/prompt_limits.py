"""Our prompt-length limits, checked inside vLLM's own prompt checks on the token count vLLM computed.

vLLM's renderer tokenizes every prompt (text, token ids, a chat rendered by its template) and
checks the tokens with the request's `TokenizeParams` (``apply_post_tokenization``).  vLLM
0.32 refuses only a prompt longer than the whole context and quietly lowers ``max_tokens`` to
what is left, so a 500-token prompt with ``max_tokens`` 20 ran on a 512-token context and
stopped short.  `PromptLimits` adds, after vLLM's checks and on the same tokens (nothing is
tokenized twice): the prompt plus ``max_tokens`` must fit in the context, and the prompt
must be at most ``--max-prompt-tokens`` long.  Both raise vLLM's `VLLMValidationError`: a 400
naming the parameter, as vLLM's own length errors are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from samrollout.server.vllm_compat.vllm_serving import TokenizeParams, VLLMValidationError


@dataclasses.dataclass(frozen=True)
class PromptLimits(TokenizeParams):
    """vLLM's tokenization parameters with our limits: context = prompt + max_tokens, and a prompt-length cap."""

    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (``--max-prompt-tokens``); None: the context length (vLLM's check)."""

    prompt_param: str = "prompt"
    """The request field a too-long prompt is reported against (``messages`` for chat)."""

    def apply_post_tokenization(self, tokenizer: Any, prompt: Any) -> Any:
        """vLLM's checks (truncation, padding, context), then ours on the resulting token count."""
        checked = super().apply_post_tokenization(tokenizer, prompt)
        tokens = checked.get("prompt_token_ids") if isinstance(checked, dict) else None
        if tokens is not None:
            self.check_prompt_length(len(tokens))
        return checked

    def check_prompt_length(self, prompt_tokens: int) -> None:
        """Raise VLLMValidationError unless a prompt of ``prompt_tokens`` tokens is within our limits."""
        limit = self.max_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise VLLMValidationError(
                f"The prompt has {prompt_tokens} tokens, more than this server's limit of {limit} "
                "(--max-prompt-tokens).", parameter=self.prompt_param, value=prompt_tokens)
        context, wanted = self.max_total_tokens, self.max_output_tokens
        if context is not None and wanted and prompt_tokens + wanted > context:
            raise VLLMValidationError(
                f"This model's maximum context length is {context} tokens, but the prompt has {prompt_tokens} "
                f"tokens and {self.max_output_tokens_param} is {wanted} ({prompt_tokens + wanted} in all). "
                f"Shorten the prompt or lower {self.max_output_tokens_param}.",
                parameter=self.max_output_tokens_param, value=wanted)


def with_prompt_limits(params: TokenizeParams, max_prompt_tokens: int | None, prompt_param: str) -> PromptLimits:
    """``params`` (what vLLM's request model built) with our limits added; every vLLM field is kept."""
    fields = {field.name: getattr(params, field.name) for field in dataclasses.fields(params) if field.init}
    return PromptLimits(**fields, max_prompt_tokens=max_prompt_tokens, prompt_param=prompt_param)
