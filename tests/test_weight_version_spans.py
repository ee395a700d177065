"""Version spans and continued sequences, without an engine: `weight_labels.WeightLabels`, `continuation`, and
`ServerRuntime.load_weights` with ``in_flight: "continue"`` on a recording stand-in engine.

The engine tests (tests/test_weight_update_continue.py) show the spans are exact on the real
engine; these pin the bookkeeping: the engine's spans passed on by choice, the fallback where
the engine reports no versions (vLLM 0.23), token counting in delta and cumulative outputs,
which of vLLM's per-sequence states a ``"continue"`` update counts as continued, and the order of
the engine calls a ``"continue"`` load makes (freeze, preempt, load, resume, even on failure).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from samrollout.metrics import definitions as m
from samrollout.server.engine.continuation import (
    SequenceProgress,
    continued,
    count_continued,
    drain_outputs,
    sequence_key,
    sequences_in_flight,
)
from samrollout.server.weights.weight_labels import WeightLabels


def completion(tokens: list[int], index: int = 0, finish: str | None = None,
               spans: list[tuple[str, int, int]] | None = None) -> Any:
    """A stand-in for vLLM's CompletionOutput (``spans``: its ``weight_versions``, (version, start, end))."""
    versions = None if spans is None else [SimpleNamespace(version=v, start=s, end=e) for v, s, e in spans]
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason=finish, weight_versions=versions)


def output(*completions: Any) -> Any:
    return SimpleNamespace(outputs=list(completions))


class NoEngine:
    """An engine that reports no versions (vLLM 0.23): no output processor to read."""


def span(start: int, end: int, version: str) -> dict[str, Any]:
    return {"start": start, "end": end, "version": version}


def test_the_engines_spans_are_passed_on_per_choice_over_a_stream() -> None:
    current = ["v1"]
    labels = WeightLabels(NoEngine(), lambda: current[0])
    labels.see("cmpl-a-0", output(completion([1, 2], index=0), completion([5], index=1)), delta=True)
    current[0] = "v2"
    labels.see("cmpl-a-0", output(completion([3], index=0, finish="length", spans=[("v1", 0, 2), ("v2", 2, 3)])),
               delta=True)
    labels.see("cmpl-a-0", output(completion([6, 7], index=1, finish="length", spans=[("v1", 0, 1), ("v2", 1, 3)])),
               delta=True)
    assert labels.spans("cmpl-a-0", 0) == [span(0, 2, "v1"), span(2, 3, "v2")]
    assert labels.choice_spans(["cmpl-a-0"], 2) == {0: [span(0, 2, "v1"), span(2, 3, "v2")],
                                                    1: [span(0, 1, "v1"), span(1, 3, "v2")]}
    assert labels.choices(["cmpl-a-0"], 2) == {0: "v1", 1: "v1"}  # the first token's version


def test_spans_are_cut_to_the_tokens_the_choice_has() -> None:
    # A stop string can trim the last tokens after the engine counted them: no span past the end, none empty.
    labels = WeightLabels(NoEngine(), lambda: "v2")
    labels.see("r", output(completion([1, 2, 3], finish="stop", spans=[("v1", 0, 3), ("v2", 3, 5)])))
    assert labels.spans("r", 0) == [span(0, 3, "v1")]


def test_without_engine_versions_a_continue_update_splits_the_spans_where_it_stopped_each_sequence() -> None:
    current = ["v1"]
    labels = WeightLabels(NoEngine(), lambda: current[0])
    labels.see("stream", output(completion([1, 2, 3])), delta=True)  # a stream, labelled as it runs
    # The update stopped "stream" after 4 tokens (one more than reached the HTTP layer) and the non-streamed
    # request "final" (no output seen yet) after 2; "fresh" had none: it starts on the new weights.
    labels.continued({("stream", 0): 4, ("final", 0): 2, ("fresh", 0): 0}, "v1", "v2")
    current[0] = "v2"
    labels.see("stream", output(completion([4, 5], finish="length")), delta=True)
    labels.see("final", output(completion([7, 8, 9, 10, 11], finish="length")))
    labels.see("fresh", output(completion([1], finish="length")))
    assert labels.spans("stream", 0) == [span(0, 4, "v1"), span(4, 5, "v2")]
    assert labels.spans("final", 0) == [span(0, 2, "v1"), span(2, 5, "v2")]
    assert labels.spans("fresh", 0) == [span(0, 1, "v2")]
    assert labels.choices(["final"], 1) == {0: "v1"}  # its first token was the old weights'
    assert labels.choices(["fresh"], 1) == {0: "v2"}


def test_two_continue_updates_make_three_spans_and_forget_drops_everything() -> None:
    labels = WeightLabels(NoEngine(), lambda: "v3")
    labels.continued({("r", 0): 2}, "v1", "v2")
    labels.continued({("r", 0): 5}, "v2", "v3")
    labels.see("r", output(completion(list(range(9)), finish="length")))
    assert labels.spans("r", 0) == [span(0, 2, "v1"), span(2, 5, "v2"), span(5, 9, "v3")]
    labels.forget(["r"])
    assert len(labels) == 0 and labels.choice_spans(["r"], 1) == {}


def test_a_choice_without_tokens_has_no_spans() -> None:
    labels = WeightLabels(NoEngine(), lambda: "v1")
    labels.see("r", output(completion([], finish="abort")))
    assert labels.choice_spans(["r"], 1) == {0: []}


def state(external: str, index: int, prompt: int, tokens: int) -> Any:
    """A stand-in for vLLM's per-sequence RequestState in the output processor."""
    detokenizer = SimpleNamespace(num_output_tokens=lambda: tokens)
    return SimpleNamespace(external_req_id=external, request_index=index, prompt_len=prompt, detokenizer=detokenizer)


def test_sequences_in_flight_finds_vllm_children_and_length_aware_children_of_the_requests_in_flight() -> None:
    states = {"a0": state("cmpl-x-0", 0, 10, 4), "a1": state("cmpl-x-0", 1, 10, 0),  # vLLM's n = 2 children
              "b": state("0_chatcmpl-y", 0, 7, 3), "c": state("2_chatcmpl-y", 0, 7, 5),  # fanned out here
              "d": state("cmpl-other-0", 0, 3, 9), "e": state("1_cmpl-other-0", 0, 3, 9)}  # not in flight here
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states=states))
    found = sequences_in_flight(engine, ["cmpl-x-0", "chatcmpl-y"])
    assert found == {("cmpl-x-0", 0): SequenceProgress(10, 4), ("cmpl-x-0", 1): SequenceProgress(10, 0),
                     ("chatcmpl-y", 0): SequenceProgress(7, 3), ("chatcmpl-y", 2): SequenceProgress(7, 5)}
    assert set(continued(found)) == {("cmpl-x-0", 0), ("chatcmpl-y", 0), ("chatcmpl-y", 2)}
    assert sequences_in_flight(SimpleNamespace(), ["cmpl-x-0"]) == {}  # no output processor: nothing known


def test_sequence_key_takes_only_the_children_it_names() -> None:
    assert sequence_key("3_cmpl-a-0", 0, {"cmpl-a-0"}) == ("cmpl-a-0", 3)
    assert sequence_key("cmpl-a-0", 2, {"cmpl-a-0"}) == ("cmpl-a-0", 2)
    assert sequence_key("x_cmpl-a-0", 0, {"cmpl-a-0"}) is None
    assert sequence_key("3_cmpl-b-0", 0, {"cmpl-a-0"}) is None


@pytest.mark.parametrize(("recomputed", "tokens"), [(True, 14 + 10), (False, 0)], ids=["continue", "continue-keep-kv"])
def test_continued_sequences_and_their_recomputed_tokens_are_counted(recomputed: bool, tokens: int) -> None:
    mode = "continue" if recomputed else "continue-keep-kv"
    counted = m.CONTINUED_SEQUENCES.labels(in_flight=mode)
    before = (counted._value.get(), m.RECOMPUTED_TOKENS._value.get())
    count_continued({("a", 0): SequenceProgress(10, 4), ("a", 1): SequenceProgress(10, 0),
                     ("b", 0): SequenceProgress(7, 3)}, mode, recomputed=recomputed)
    after = (counted._value.get(), m.RECOMPUTED_TOKENS._value.get())
    assert (after[0] - before[0], after[1] - before[1]) == (2, tokens)


@pytest.mark.parametrize("pending", [0, 3])
def test_drain_outputs_returns_once_the_output_queue_is_empty(pending: int) -> None:
    async def scenario() -> int:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(pending):
            queue.put_nowait(i)

        async def handler() -> None:  # vLLM's output handler, taking one batch per turn
            while True:
                await queue.get()
                await asyncio.sleep(0.01)

        task = asyncio.create_task(handler())
        await drain_outputs(SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue)), timeout=5)
        left = queue.qsize()
        task.cancel()
        return left

    assert asyncio.run(scenario()) == 0
    asyncio.run(drain_outputs(SimpleNamespace(), timeout=0.1))  # no queue to watch: returns at once


# --- ServerRuntime.load_weights with "continue", on a recording stand-in engine ---

class RecordingEngine:
    """An AsyncLLM stand-in: records the calls a weight load makes; two sequences of one request are in flight."""

    def __init__(self, fail_reload: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_reload = fail_reload
        self.output_processor = SimpleNamespace(request_states={
            "a": state("cmpl-r-0", 0, 6, 5), "b": state("cmpl-r-0", 1, 6, 0)})

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.calls.append(("collective_rpc", method))
        if method == "samrollout_reload_weights" and self.fail_reload:
            raise RuntimeError("reload failed")
        return [None]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", None))


def runtime_with(engine: RecordingEngine, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ServerRuntime around ``engine`` (the pieces a weight load does not touch left out); the weights check and
    the vLLM layout stubbed (no vLLM here)."""
    import sys
    from pathlib import Path

    from samrollout.server.engine import runtime as runtime_module
    from samrollout.server.request_state.inflight import InflightRequest

    async def pause_engine(engine: RecordingEngine, mode: str, clear_cache: bool) -> None:
        engine.calls.append(("pause", (mode, clear_cache)))

    async def set_engine_weight_version(engine: RecordingEngine, version: str) -> None:
        engine.calls.append(("version", version))

    async def checked(*args: Any, **kwargs: Any) -> Path:
        return Path("/weights")

    monkeypatch.setitem(sys.modules, "samrollout.server.vllm_compat.vllm_serving", SimpleNamespace(
        pause_engine=pause_engine, set_engine_weight_version=set_engine_weight_version))
    monkeypatch.setattr(runtime_module, "call_with_deadline", checked)
    settings = SimpleNamespace(weight_check_timeout=10.0, weight_value_check=False)
    runtime = runtime_module.ServerRuntime(settings=settings, engine=engine, generation=engine,
                                           state=None, model_name="tiny", vocab_size=10, max_model_len=64,
                                           weight_version="v1", rollouts=None, weight_uploads=None, queue=None,
                                           weight_peers=None)
    runtime.inflight._requests["r"] = InflightRequest("r", "completion", 1, None)  # engine id cmpl-r-0
    return runtime


def test_a_continue_load_freezes_preempts_loads_then_resumes_and_splits_the_spans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = RecordingEngine()
    runtime = runtime_with(engine, monkeypatch)
    before = m.CONTINUED_SEQUENCES.labels(in_flight="continue")._value.get()
    result = asyncio.run(runtime.load_weights("/weights", "v2", "continue", param="path", source="test"))
    assert engine.calls == [("pause", ("keep", True)), ("reset_prefix_cache", True),
                            ("collective_rpc", "samrollout_reload_weights"), ("reset_prefix_cache", False),
                            ("collective_rpc", "samrollout_reset_drafter"), ("version", "v2"),
                            ("resume_generation", None)]
    assert result["continued_requests"] == 1 and result["recomputed_tokens"] == 6 + 5 and result["paused_s"] >= 0
    assert m.CONTINUED_SEQUENCES.labels(in_flight="continue")._value.get() - before == 1
    labels = runtime.labels
    labels.see("cmpl-r-0", output(completion(list(range(8)), finish="length")))
    assert labels.spans("cmpl-r-0", 0) == [span(0, 5, "v1"), span(5, 8, "v2")]  # no engine spans: the fallback


def test_wait_and_abort_loads_pause_as_before_and_report_no_continuation(monkeypatch: pytest.MonkeyPatch) -> None:
    for mode in ("wait", "abort"):
        engine = RecordingEngine()
        result = asyncio.run(runtime_with(engine, monkeypatch).load_weights("/weights", "v2", mode,
                                                                            param="path", source="test"))
        assert engine.calls[0] == ("pause", (mode, True)) and ("reset_prefix_cache", True) not in engine.calls
        assert "continued_requests" not in result and result["in_flight"] == mode


def test_a_continue_load_that_fails_resumes_the_engine_and_counts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = RecordingEngine(fail_reload=True)
    runtime = runtime_with(engine, monkeypatch)
    before = m.CONTINUED_SEQUENCES.labels(in_flight="continue")._value.get()
    with pytest.raises(RuntimeError, match="reload failed"):
        asyncio.run(runtime.load_weights("/weights", "v2", "continue", param="path", source="test"))
    assert engine.calls[-1] == ("resume_generation", None) and runtime.weight_version == "v1"
    assert m.CONTINUED_SEQUENCES.labels(in_flight="continue")._value.get() == before
