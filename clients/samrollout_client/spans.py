"""Weight-version spans: which of a sample's tokens each weight version sampled.

The server puts ``weight_version_spans`` on every choice (a stream: on the chunk that ends it),
``[{"start", "end", "version"}]`` over the choice's ``token_ids``, ``end`` exclusive.  More
than one span means a weight update with ``in_flight: "continue"`` ran while it generated.
A server from before the spans sends none: the choice is then one span of the response's
``weight_version``.  A divided sample (`samrollout_client.rollouts.divided`) joins its pieces' spans,
each shifted by the tokens before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from samrollout_client.types import WeightVersionSpan


def parse_spans(raw: Any, tokens: int, fallback: str | None) -> list[WeightVersionSpan]:
    """The spans of a choice with ``tokens`` token ids, from the server's ``weight_version_spans``.

    Spans are cut to ``tokens`` and empty ones dropped.  Without spans from the server (an older
    server, or a streamed piece the client hung up on before its last chunk), all ``tokens`` are
    one span of ``fallback`` (the version the response or chunk names: its first token's).
    """
    spans: list[WeightVersionSpan] = []
    if isinstance(raw, list) and raw:
        for item in raw:
            if not isinstance(item, dict):
                continue
            start, end = max(0, int(item.get("start", 0))), min(tokens, int(item.get("end", 0)))
            if end > start:
                version = item.get("version")
                spans.append(WeightVersionSpan(start=start, end=end,
                                               version=None if version is None else str(version)))
        if spans:
            return spans
    return [WeightVersionSpan(start=0, end=tokens, version=fallback)] if tokens > 0 else []


def join_spans(pieces: Iterable[tuple[int, Sequence[WeightVersionSpan]]]) -> list[WeightVersionSpan]:
    """One sample's spans from its pieces' ``(tokens, spans)`` in order, each piece's spans shifted by the tokens
    before it; neighbouring spans of one version become one."""
    joined: list[WeightVersionSpan] = []
    offset = 0
    for tokens, spans in pieces:
        for span in spans:
            start, end = offset + span.start, offset + min(span.end, tokens)
            if end <= start:
                continue
            if joined and joined[-1].version == span.version and joined[-1].end == start:
                joined[-1] = WeightVersionSpan(start=joined[-1].start, end=end, version=span.version)
            else:
                joined.append(WeightVersionSpan(start=start, end=end, version=span.version))
        offset += tokens
    return joined
