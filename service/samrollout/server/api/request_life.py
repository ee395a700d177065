"""One generation request's life, from admission to its end, in one object: `RequestLife`.

What a request holds: its place in the bounded queue (`queue_limit`), the weight-version labels of its sequences
(`weight_labels`), its rollout's running count (`metrics.rollouts`) and, when it ends, what each of its sequences
did (its response's or stream's outcome).  The route admits it (429 when the queue is full), starts it once the
engine request ids are known, and the one object gives everything back, once: its rollout and labels when the
response is complete, and its queue place (with anything not yet given back) at the end of the request's ASGI
call (`request_end`), however it ends: a stream whose generator never ran (the client left first) still ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from samrollout.metrics.rollouts import SequenceOutcome
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.request_state.inflight import InflightRequest
from samrollout.server.request_state.request_end import Scope, at_request_end
from samrollout.server.weights.weight_labels import WeightLabels


def outcomes_of(body: dict[str, Any]) -> list[SequenceOutcome]:
    """Each choice's length, finish reason, weight version and (with per-request metrics, n = 1) accepted draft
    tokens."""
    choices = body.get("choices") or []
    spec = ((body.get("metrics") or {}).get("speculative_decoding") or {}) if len(choices) == 1 else {}
    usage = body.get("usage") or {}
    outcomes = []
    for choice in choices:
        ids = choice.get("token_ids")
        tokens = len(ids) if isinstance(ids, list) else int(usage.get("completion_tokens", 0)) // max(1, len(choices))
        outcomes.append(SequenceOutcome(tokens, spec.get("num_accepted_draft_tokens"), choice.get("finish_reason"),
                                        choice.get("weight_version") or body.get("weight_version")))
    return outcomes


class VersionLabels:
    """The weight versions of one HTTP request's sequences (`weight_labels`), as its body and chunks carry them."""

    def __init__(self, runtime: ServerRuntime, tracked: InflightRequest, n: int) -> None:
        labels = runtime.labels
        assert labels is not None  # ServerRuntime always has them
        self.labels: WeightLabels = labels
        self.engine_ids, self.n = tracked.engine_ids(), n

    def request(self) -> str:
        """The request's label: the version of its first sampled token."""
        return self.labels.request(self.engine_ids)

    def choices(self) -> dict[int, str]:
        """Each labelled choice's version, by choice index."""
        return self.labels.choices(self.engine_ids, self.n)

    def stamp(self, payload: dict[str, Any], body: bool = False) -> None:
        """Label a body or chunk: each choice with its sequence's version, the whole with the request's label (a
        body) or the chunk's choice's (a chunk; the request's label where it carries no labelled choice).  Each
        choice of a ``body``, and each choice a chunk ends (it has a finish reason), also gets its
        ``weight_version_spans`` (`weight_labels`): which of its tokens each version sampled, over all its tokens
        (for a stream: all its chunks')."""
        labels, choices = self.choices(), payload.get("choices") or []
        versions = [labels.get(int(choice.get("index", 0))) for choice in choices]
        request = self.request()
        spans = self.labels.choice_spans(self.engine_ids, self.n) if choices else {}
        for choice, version in zip(choices, versions, strict=True):
            choice["weight_version"] = version or request
            if body or choice.get("finish_reason") is not None:
                choice["weight_version_spans"] = spans.get(int(choice.get("index", 0)), [])
        # A body's label is the request's (its first sampled token's version); a chunk's, its choice's.
        payload["weight_version"] = request if body else next((v for v in versions if v is not None), request)

    def forget(self) -> None:
        """The request ended: drop its labels."""
        self.labels.forget(self.engine_ids)


class StreamOutcomes:
    """Per-choice token counts and finish reasons gathered from the chunks of a stream of ``choices`` choices."""

    def __init__(self, choices: int) -> None:
        self.choices = choices
        self.tokens: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}
        self.spec: dict[str, Any] = {}

    def see(self, payload: dict[str, Any]) -> None:
        """Count one chunk's tokens and finish reasons, and keep its speculative-decoding metrics."""
        for choice in payload.get("choices") or []:
            index = int(choice.get("index", 0))
            self.tokens[index] = self.tokens.get(index, 0) + len(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.finish[index] = choice["finish_reason"]
        spec = (payload.get("metrics") or {}).get("speculative_decoding")
        if spec:
            self.spec = spec

    def outcomes(self, versions: dict[int, str], request_version: str) -> list[SequenceOutcome]:
        """One outcome per choice, with its weight version (``versions``, else ``request_version``); a choice
        the stream never finished (the client hung up) was aborted."""
        accepted = self.spec.get("num_accepted_draft_tokens") if self.choices == 1 else None
        return [SequenceOutcome(self.tokens.get(i, 0), accepted, self.finish.get(i) or "abort",
                                versions.get(i, request_version))
                for i in range(self.choices)]


class RequestLife:
    """Everything one generation request holds, given back once (see the module docstring)."""

    def __init__(self, runtime: ServerRuntime, scope: Scope, sequences: int) -> None:
        """Admit ``sequences`` (prompts x n) to the bounded queue (ApiError 429 when they do not fit) and give them
        back when the request's ASGI call ends."""
        runtime.queue.admit(sequences)
        self.runtime, self.sequences = runtime, sequences
        self.labels: VersionLabels | None = None
        self.rollout: str | None = None
        self.outcomes: Callable[[], list[SequenceOutcome]] = list  # none known (no response began): none counted
        self._finished = self._ended = False
        at_request_end(scope, self.end)

    def start(self, tracked: InflightRequest, rollout: str | None, n: int) -> VersionLabels:
        """The request goes to the engine as ``tracked``: label its sequences, count them in ``rollout``."""
        self.labels = VersionLabels(self.runtime, tracked, n)
        self.rollout = rollout
        if rollout is not None:
            self.runtime.rollouts.begin(rollout, self.sequences)
        return self.labels

    def finish(self) -> None:
        """The response is complete (or failed): its rollout counts what its sequences did (`outcomes`), its labels
        are dropped.  Once; `end` calls it too."""
        if self._finished:
            return
        self._finished = True
        if self.rollout is not None:
            self.runtime.rollouts.end(self.rollout, self.sequences, self.outcomes())
        if self.labels is not None:
            self.labels.forget()

    def end(self) -> None:
        """The request's ASGI call ended: `finish` if not done yet, and give its queue place back.  Once."""
        if self._ended:
            return
        self._ended = True
        try:
            self.finish()
        finally:
            self.runtime.queue.release(self.sequences)
