"""Which weight version produced each sequence: the label on responses, streamed chunks and rollouts.

The rule: a sequence (one choice) carries the version of the weights that sampled its first
token, as the engine reports it.  vLLM 0.32's engine core stamps every step's outputs with
its current weight version, which the server changes only while generation is paused for an
update, so the label is exact in every update mode: with ``in_flight: "wait"`` the running
sequences finish on the old weights before the load and sequences still queued (in the
engine or arriving during the pause) run on the new ones; with ``"abort"`` the in-flight
ones end with old tokens only; with ``"continue"`` they keep their old first token (and
carry version spans, below).  It does not depend on when the HTTP layer reads the tokens,
so a slow client reading a stream after the update still sees the old label, and a label
never changes once given.  Where the engine reports no version (vLLM 0.23), and for a
sequence that ends without any token, the label is the server's version when the sequence's
first output reached the HTTP layer (for a sequence a ``"continue"`` update stopped: the
version it started under).

A request's label (the ``weight_version`` of a response body, and of streamed chunks that
carry no choice) is the label of its first sampled token: normally every choice has it;
only a ``"wait"`` update can split a request with several sequences, when some ran and
others were still queued in the engine, and then each choice's own label says which.

A sequence continued across a ``"continue"`` update (`continuation`) has tokens of two (or
more) versions: its label stays its first token's, and its version spans say which tokens each
version sampled: ``[{"start": 0, "end": k, "version": old}, {"start": k, "end": n, "version":
new}]``, token indexes of its output, end exclusive.  They are the engine's own
(``CompletionOutput.weight_versions``, on a sequence's final output, stamped by the engine
core at each step: exact), or, where the engine reports none (vLLM 0.23), built from the
label and the token counts `continuation` read at each ``"continue"`` update.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

from samrollout.server.request_state.engine_ids import child_request_id

Span = dict[str, Any]  # {"start": first output-token index, "end": exclusive, "version": str}


def engine_first_token_version(engine: Any, request_id: str, completion: Any) -> str | None:
    """The version the engine reports for ``completion``'s first token, or None where it reports none.

    A finished completion carries its spans (``CompletionOutput.weight_versions``); a running
    one is read from vLLM's output processor in this process (its per-sequence state), under
    vLLM's own id or, for a sequence the length-aware client fanned out, its child's id.
    """
    spans = getattr(completion, "weight_versions", None)
    if spans:
        return str(spans[0].version)
    index = int(getattr(completion, "index", 0))
    try:
        processor = engine.output_processor
        for external, wanted in ((request_id, index), (child_request_id(request_id, index), 0)):
            for internal in processor.external_req_ids.get(external, ()):
                state = processor.request_states.get(internal)
                if state is not None and state.request_index == wanted and state.weight_version_starts:
                    return str(state.weight_version_starts[0][0])
    except (AttributeError, TypeError):
        return None
    return None


class WeightLabels:
    """The label and version spans of every sequence of the HTTP requests in flight, by engine request id and index.

    Labels are given by `LabellingEngineClient` as outputs pass, and forgotten by the route
    when its HTTP request ends (single event loop: no locking needed).
    """

    def __init__(self, engine: Any, current: Callable[[], str]) -> None:
        self._engine = engine
        self.current = current  # the server's version now: the fallback label
        self._order = itertools.count()
        self._labels: dict[str, dict[int, tuple[int, str]]] = {}
        self._tokens: dict[str, dict[int, int]] = {}  # output tokens seen so far, per sequence
        self._engine_spans: dict[str, dict[int, list[Span]]] = {}  # the engine's spans, from final outputs
        self._starts: dict[str, dict[int, list[tuple[int, str]]]] = {}  # (first token, version) per continue update

    def see(self, request_id: str, output: Any, delta: bool = False) -> None:
        """Label the completions of ``output`` (vLLM's RequestOutput) that have their first token or ended; count
        their tokens (``delta``: the output carries new tokens only, as streams ask); keep the engine's spans."""
        for completion in getattr(output, "outputs", None) or []:
            index = int(getattr(completion, "index", 0))
            tokens = self._tokens.setdefault(request_id, {})
            new = len(completion.token_ids or ())
            tokens[index] = tokens.get(index, 0) + new if delta else new
            spans = getattr(completion, "weight_versions", None)
            if spans:
                self._engine_spans.setdefault(request_id, {})[index] = [
                    {"start": int(span.start), "end": int(span.end), "version": str(span.version)} for span in spans]
            labels = self._labels.setdefault(request_id, {})
            if index in labels or not (completion.token_ids or completion.finish_reason is not None):
                continue
            version = (engine_first_token_version(self._engine, request_id, completion)
                       or self._recorded_first(request_id, index) or self.current())
            labels[index] = (next(self._order), version)

    def continued(self, tokens: dict[tuple[str, int], int], old: str, new: str) -> None:
        """A ``"continue"`` update from ``old`` to ``new`` stopped sequence (request id, index) after ``tokens`` of
        its output tokens: the rest are ``new``'s (the spans where the engine reports none)."""
        for (request_id, index), count in tokens.items():
            if count <= 0:
                continue
            starts = self._starts.setdefault(request_id, {}).setdefault(index, [])
            if not starts:
                label = self._labels.get(request_id, {}).get(index)
                starts.append((0, label[1] if label is not None else old))
            starts.append((count, new))

    def _recorded_first(self, request_id: str, index: int) -> str | None:
        starts = self._starts.get(request_id, {}).get(index)
        return starts[0][1] if starts else None

    def spans(self, request_id: str, index: int) -> list[Span]:
        """Sequence ``index`` of ``request_id``: which output tokens each weight version sampled, in order."""
        count = self._tokens.get(request_id, {}).get(index, 0)
        engine = self._engine_spans.get(request_id, {}).get(index)
        if engine is not None:
            return _within(engine, count)
        label = self._labels.get(request_id, {}).get(index)
        starts = self._starts.get(request_id, {}).get(index) or [(0, label[1] if label else self.current())]
        ends = [start for start, _ in starts[1:]] + [count]
        return _within([{"start": start, "end": end, "version": version}
                        for (start, version), end in zip(starts, ends, strict=True)], count)

    def choices(self, engine_ids: list[str], per_engine_request: int) -> dict[int, str]:
        """The labels of an HTTP request's choices: engine request ``k``'s completion ``i`` is choice ``k * n + i``."""
        return {k * per_engine_request + index: version
                for k, engine_id in enumerate(engine_ids)
                for index, (_, version) in self._labels.get(engine_id, {}).items()}

    def choice_spans(self, engine_ids: list[str], per_engine_request: int) -> dict[int, list[Span]]:
        """The version spans of an HTTP request's choices that produced output, by choice index (as `choices`)."""
        return {k * per_engine_request + index: self.spans(engine_id, index)
                for k, engine_id in enumerate(engine_ids)
                for index in self._tokens.get(engine_id, {})}

    def request(self, engine_ids: list[str]) -> str:
        """The request's label: its first sampled token's version (the server's version before any)."""
        first = min((label for engine_id in engine_ids for label in self._labels.get(engine_id, {}).values()),
                    default=None)
        return first[1] if first is not None else self.current()

    def forget(self, engine_ids: Iterable[str]) -> None:
        """Drop the labels of an HTTP request that ended."""
        for engine_id in engine_ids:
            self._labels.pop(engine_id, None)
            self._tokens.pop(engine_id, None)
            self._engine_spans.pop(engine_id, None)
            self._starts.pop(engine_id, None)

    def __len__(self) -> int:
        return len(self._labels)


def _within(spans: list[Span], count: int) -> list[Span]:
    """``spans`` cut to the ``count`` tokens the sequence has (a stop string can trim its last tokens), none empty."""
    kept = []
    for span in spans:
        start, end = max(0, int(span["start"])), min(int(span["end"]), count)
        if start < end:
            kept.append({"start": start, "end": end, "version": span["version"]})
    return kept


class LabellingEngineClient:
    """The engine client vLLM's serving objects call: the generation client, with each output labelled.

    Everything but `generate` goes to the wrapped client (the engine, or length-aware admission).
    """

    def __init__(self, client: Any, labels: WeightLabels) -> None:
        self._client = client
        self.labels = labels

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        """The wrapped client's `generate`, labelling each output's sequences before vLLM formats it."""
        delta = getattr(getattr(sampling_params, "output_kind", None), "name", None) == "DELTA"
        async for output in self._client.generate(prompt, sampling_params, request_id, **kwargs):
            self.labels.see(request_id, output, delta)
            yield output


def labelling_client(client: Any, labels: WeightLabels) -> Any:
    """``client`` as vLLM's serving objects get it (`init_app_state`): each output labelled in ``labels``."""
    return LabellingEngineClient(client, labels)
