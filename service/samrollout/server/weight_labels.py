"""Which weight version produced each sequence: the label on responses, streamed chunks and rollouts.

The rule: a sequence (one choice) carries the version of the weights that sampled its first
token, as the engine reports it.  vLLM 0.32's engine core stamps every step's outputs with
its current weight version, which the server changes only while generation is paused for an
update, so the label is exact in both update modes: with ``in_flight: "wait"`` the running
sequences finish on the old weights before the load and sequences still queued (in the
engine or arriving during the pause) run on the new ones; with ``"abort"`` the in-flight
ones end with old tokens only.  It does not depend on when the HTTP layer reads the tokens,
so a slow client reading a stream after the update still sees the old label, and a label
never changes once given.  Where the engine reports no version (vLLM 0.23), and for a
sequence that ends without any token, the label is the server's version when the sequence's
first output reached the HTTP layer.

A request's label (the ``weight_version`` of a response body, and of streamed chunks that
carry no choice) is the label of its first sampled token: normally every choice has it;
only a ``"wait"`` update can split a request with several sequences, when some ran and
others were still queued in the engine, and then each choice's own label says which.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

from samrollout.server.scheduled_engine import child_request_id


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
    """The label of every sequence of the HTTP requests in flight, by engine request id and choice index.

    Labels are given by `LabellingEngineClient` as outputs pass, and forgotten by the route
    when its HTTP request ends (single event loop: no locking needed).
    """

    def __init__(self, engine: Any, current: Callable[[], str]) -> None:
        self._engine = engine
        self.current = current  # the server's version now: the fallback label
        self._order = itertools.count()
        self._labels: dict[str, dict[int, tuple[int, str]]] = {}

    def see(self, request_id: str, output: Any) -> None:
        """Label the completions of ``output`` (vLLM's RequestOutput) that have their first token or ended."""
        for completion in getattr(output, "outputs", None) or []:
            labels = self._labels.setdefault(request_id, {})
            index = int(getattr(completion, "index", 0))
            if index in labels or not (completion.token_ids or completion.finish_reason is not None):
                continue
            version = engine_first_token_version(self._engine, request_id, completion) or self.current()
            labels[index] = (next(self._order), version)

    def choices(self, engine_ids: list[str], per_engine_request: int) -> dict[int, str]:
        """The labels of an HTTP request's choices: engine request ``k``'s completion ``i`` is choice ``k * n + i``."""
        return {k * per_engine_request + index: version
                for k, engine_id in enumerate(engine_ids)
                for index, (_, version) in self._labels.get(engine_id, {}).items()}

    def request(self, engine_ids: list[str]) -> str:
        """The request's label: its first sampled token's version (the server's version before any)."""
        first = min((label for engine_id in engine_ids for label in self._labels.get(engine_id, {}).values()),
                    default=None)
        return first[1] if first is not None else self.current()

    def forget(self, engine_ids: Iterable[str]) -> None:
        """Drop the labels of an HTTP request that ended."""
        for engine_id in engine_ids:
            self._labels.pop(engine_id, None)

    def __len__(self) -> int:
        return len(self._labels)


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
        async for output in self._client.generate(prompt, sampling_params, request_id, **kwargs):
            self.labels.see(request_id, output)
            yield output


def labelling_client(client: Any, labels: WeightLabels) -> Any:
    """``client`` as vLLM's serving objects get it (`init_app_state`): each output labelled in ``labels``."""
    return LabellingEngineClient(client, labels)
