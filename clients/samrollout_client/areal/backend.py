"""AReaL's vLLM backend, with two changes: a pause freezes requests instead of aborting them, and each reply's
per-token weight versions are kept for the engine (`samrollout_client.areal.engine`).

AReaL's ``HttpGenerationResult`` has no field for versions: the backend parses a reply inside
``RemoteInfEngine.agenerate`` and hands back tokens and logprobs only.  So the versions go
aside, to the `ReplyVersions` that the engine's ``agenerate`` opened for the request being
generated (a context variable: each ``agenerate`` runs in its own asyncio task or context).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from areal.api.io_struct import HttpGenerationResult, HttpRequest
from areal.engine.vllm_remote import VLLMBackend

from samrollout_client.spans import parse_spans


@dataclass
class ReplyVersions:
    """The replies of one generation so far: each one's token count and, when the server said, each token's version."""

    replies: list[tuple[int, list[int] | None]] = field(default_factory=list)

    def add(self, tokens: int, versions: list[int] | None) -> None:
        """One more reply of ``tokens`` tokens; ``versions``: one int per token, or None (the server gave none)."""
        self.replies.append((tokens, versions))

    def apply(self, stamped: list[int]) -> list[int] | None:
        """AReaL's per-token versions (``stamped``: the client's version when each reply arrived) with the server's
        in place of each reply's where it gave them; None when the replies do not add up to ``stamped``."""
        if sum(tokens for tokens, _ in self.replies) != len(stamped):
            return None
        merged, start = list(stamped), 0
        for tokens, versions in self.replies:
            if versions is not None:
                merged[start:start + tokens] = versions
            start += tokens
        return merged


REPLY_VERSIONS: contextvars.ContextVar[ReplyVersions | None] = contextvars.ContextVar(
    "samrollout_areal_reply_versions", default=None)


def token_versions(choice: dict[str, Any], tokens: int) -> list[int] | None:
    """Each of a choice's ``tokens`` tokens' weight version as AReaL's int, from ``weight_version_spans``; None
    when the server gave no spans covering them all or a version is not an int (a ``--weight-version`` name)."""
    spans = parse_spans(choice.get("weight_version_spans"), tokens, None)
    versions: list[int] = []
    for span in spans:
        if span.version is None or not span.version.lstrip("-").isdigit() or span.start != len(versions):
            return None
        versions.extend([int(span.version)] * (span.end - span.start))
    return versions if len(versions) == tokens else None


class SamrolloutBackend(VLLMBackend):  # type: ignore[misc]  # AReaL ships no type information
    """`VLLMBackend` for samrollout servers: pauses keep requests going (``in_flight: continue``); replies' versions
    reach the engine."""

    def get_pause_request(self) -> HttpRequest:
        """Freeze the requests in flight: they go on under the next weights, in the same response."""
        return HttpRequest(endpoint="/areal_pause_generation", payload={"in_flight": "continue"})

    def parse_generation_response(self, response: dict[str, Any]) -> HttpGenerationResult:
        """AReaL's parse, and the reply's per-token versions set aside for the engine (`REPLY_VERSIONS`)."""
        result: HttpGenerationResult = super().parse_generation_response(response)
        collected = REPLY_VERSIONS.get()
        if collected is not None:
            choices = response.get("choices") or [{}]
            tokens = len(result.output_tokens)
            collected.add(tokens, token_versions(choices[0], tokens) if isinstance(choices[0], dict) else None)
        return result
