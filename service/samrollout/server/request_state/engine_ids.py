"""The ids vLLM gives an HTTP request's engine requests: computed here and nowhere else.

vLLM's serving layer names a completion of P prompts ``cmpl-{id}-0 .. cmpl-{id}-{P-1}`` and a chat completion
``chatcmpl-{id}`` (its response id); a request fanned out to ``n`` children is ``{i}_{parent}`` per child.  The
in-flight registry (abort by rollout), the stream's response id, weight labels and continuation all read them.
"""

from __future__ import annotations


def response_id(kind: str, base_id: str) -> str:
    """The response id vLLM gives an HTTP request of ``kind`` (and, for a chat, its engine request's id)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base_id}"


def engine_request_ids(kind: str, base_id: str, prompts: int) -> list[str]:
    """The external ids of the engine requests of one HTTP request: one per prompt, one for a chat."""
    if kind == "chat":
        return [response_id(kind, base_id)]
    return [f"{response_id(kind, base_id)}-{i}" for i in range(prompts)]


def child_request_id(parent_id: str, index: int) -> str:
    """The engine request id of child ``index`` of a request fanned out here (vLLM's own naming of children)."""
    return f"{index}_{parent_id}"
