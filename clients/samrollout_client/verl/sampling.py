"""veRL's token-in-token-out request and reply, as samrollout completion requests and replies.

veRL hands a rollout server ``prompt_ids`` and a ``sampling_params`` dict (vLLM's
names: temperature, top_p, top_k, repetition_penalty, a boolean ``logprobs``, ...) and
expects token ids, their logprobs and a stop reason back.  The response length follows
veRL's vLLM server: ``max_tokens`` when given, else the configured response length within
the configured prompt + response budget, and always within the server's context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from samrollout_client.protocol.prompt_identity import GROUP_KEY_SIZE, prompt_id

# veRL sampling keys that are not vLLM completion fields, or that we set ourselves.
_HANDLED = {"max_tokens", "max_new_tokens", "logprobs", "n"}


@dataclass(frozen=True)
class LengthBudget:
    """veRL's configured lengths and the server's context, for a request's ``max_tokens``."""

    prompt_length: int
    response_length: int
    max_model_len: int


def max_new_tokens(prompt_len: int, sampling_params: Mapping[str, Any], budget: LengthBudget) -> int:
    """How many tokens the response may have (veRL's rule); ValueError when the prompt leaves no room."""
    room = budget.max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt length ({prompt_len}) leaves no room to generate within the server's context "
                         f"({budget.max_model_len} tokens)")
    requested = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
    if requested is None:
        requested = min(budget.response_length, budget.prompt_length + budget.response_length - prompt_len)
    return max(1, min(int(requested), room))


def group_key(prompt_ids: Sequence[int]) -> str:
    """A GRPO group's key: the responses to one prompt share its token ids (veRL sends no group id).

    The prompt's identity (`samrollout_client.protocol.prompt_identity`) in `GROUP_KEY_SIZE` bytes: the router
    (`samrollout_client.verl.router`) and the servers compare these keys across processes.
    """
    return prompt_id(prompt_ids, GROUP_KEY_SIZE)


def completion_body(model: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any],
                    budget: LengthBudget, *, rollout_id: str, default_seed: int | None = None,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The samrollout ``/v1/completions`` body for one veRL ``generate`` call (one response)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("an empty prompt cannot be generated from")
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "n": 1,
        "max_tokens": max_new_tokens(len(prompt), sampling_params, budget),
        "rollout_id": rollout_id, "group_id": f"{rollout_id}.{group_key(prompt)}",
        "return_token_ids": True, **(extra or {})}
    for key, value in sampling_params.items():
        if key not in _HANDLED and value is not None:
            body[key] = value
    if sampling_params.get("logprobs"):
        body["logprobs"] = 0  # the sampled token's own logprob, as veRL's vLLM server asks
    if default_seed is not None:
        body.setdefault("seed", default_seed)
    return body


def stop_reason(finish_reason: str | None) -> str | None:
    """veRL's stop reason for an OpenAI finish reason: 'completed', 'aborted', or the reason as it is."""
    if finish_reason == "abort":
        return "aborted"
    if finish_reason in ("stop", "length"):
        return "completed"
    return finish_reason


def global_steps(weight_version: str | None) -> int | None:
    """The trainer step a weight version names (veRL pushes ``str(global_steps)``); None for other versions."""
    if weight_version is not None and weight_version.isdigit():
        return int(weight_version)
    return None


def newest_version(choice: Mapping[str, Any], fallback: Any) -> str | None:
    """The newest weight version that sampled a choice: its last ``weight_version_spans`` span's, else ``fallback``.

    With ``in_flight: "continue"`` a response may run across a weight update; its reply's
    ``weight_version`` is then the first token's version, and the last span names the newest.
    """
    spans = choice.get("weight_version_spans")
    if isinstance(spans, list) and spans and isinstance(spans[-1], Mapping) and spans[-1].get("version") is not None:
        return str(spans[-1]["version"])
    return None if fallback is None else str(fallback)


def reply_fields(reply: Mapping[str, Any], want_logprobs: bool) -> dict[str, Any]:
    """token_ids, log_probs, stop_reason and extra_fields of a veRL TokenOutput, from a completion reply."""
    choice = reply["choices"][0]
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    log_probs = None
    if want_logprobs:
        log_probs = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(log_probs) != len(token_ids):
            raise ValueError(f"the server returned {len(log_probs)} logprobs for {len(token_ids)} tokens")
    spec = (reply.get("metrics") or {}).get("speculative_decoding") or {}
    version = newest_version(choice, reply.get("weight_version"))
    extra: dict[str, Any] = {"global_steps": global_steps(version), "weight_version": version,
                             "group_id": reply.get("group_id")}
    spans = choice.get("weight_version_spans")
    if isinstance(spans, list) and spans:
        # veRL's LLMServerClient fills min/max_global_steps with global_steps unless set: the span versions
        oldest = global_steps(str(spans[0].get("version"))) if isinstance(spans[0], Mapping) else None
        if oldest is not None and extra["global_steps"] is not None:
            extra["min_global_steps"], extra["max_global_steps"] = oldest, extra["global_steps"]
    if spec:
        extra["spec_num_draft_tokens"] = spec.get("num_draft_tokens")
        extra["spec_num_accepted_tokens"] = spec.get("num_accepted_draft_tokens")
    return {"token_ids": token_ids, "log_probs": log_probs, "stop_reason": stop_reason(choice.get("finish_reason")),
            "extra_fields": extra}
