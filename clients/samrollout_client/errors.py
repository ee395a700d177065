"""Errors the client raises; each names what failed, and rollout errors carry the partial results."""

from __future__ import annotations

from typing import TYPE_CHECKING

from samrollout_client.protocol.weight_uploads import error_text

if TYPE_CHECKING:
    import httpx

    from samrollout_client.types import GroupResult, SampleFailure


def error_message(reply: httpx.Response, limit: int = 200) -> str:
    """The message of a server's OpenAI-style error reply, or the start of its body when it has none."""
    return error_text(reply.text, limit)


class SamrolloutError(Exception):
    """Base class of the client's errors."""


class RequestRejected(SamrolloutError):
    """The server refused a request (4xx): retrying elsewhere would not help."""

    def __init__(self, endpoint: str, status: int, message: str) -> None:
        super().__init__(f"{endpoint} rejected the request ({status}): {message}")
        self.endpoint, self.status, self.message = endpoint, status, message


class NoEndpointAvailable(SamrolloutError):
    """Every endpoint is marked down."""


class RolloutFailed(SamrolloutError):
    """Some samples failed after their retries (or the rollout timed out).

    ``failures`` names each missing sample; ``partial`` holds every group, with the
    samples that did succeed (a failed sample's slot is None).
    """

    def __init__(self, message: str, failures: list[SampleFailure], partial: list[GroupResult]) -> None:
        lines = "; ".join(f"group {f.group} sample {f.sample}: {f.error}" for f in failures[:10])
        more = f" (and {len(failures) - 10} more)" if len(failures) > 10 else ""
        super().__init__(f"{message}: {len(failures)} sample(s) failed: {lines}{more}")
        self.failures, self.partial = failures, partial
