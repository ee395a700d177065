"""Weight updates with ``in_flight: "continue"``: requests in flight keep their place and go on under the new weights.

No request is ended and resubmitted.  vLLM's engine already has what continuing needs, in all
three supported series (0.23, 0.32, 0.33):

- ``pause_generation(mode="keep")`` stops scheduling at a step boundary (PAUSED_ALL) without
  ending anything, and queues requests that arrive meanwhile;
- ``reset_prefix_cache(reset_running_requests=True)`` preempts every running request: its KV
  blocks are freed and it goes back to the head of the waiting queue with its prompt and the
  tokens it generated, as a preemption for KV memory does (``Scheduler.reset_prefix_cache``,
  ``Scheduler._preempt_request``);
- on resume the engine prefills prompt + generated tokens again (the KV recomputed under the
  new weights) and samples the next token from the new weights.

So each request stays one engine request: its stream, its id (``abort_rollout`` and client
disconnects reach it as before), ``max_tokens`` / ``min_tokens``, stop strings and penalties
(which count its generated tokens as generated, not as prompt) carry over untouched, and every
token's logprobs are those of the weights that sampled it.  vLLM 0.32 and 0.33 stamp every step's
outputs with the engine's weight version, so each finished sequence carries its exact version
spans (``CompletionOutput.weight_versions``); the server passes them on (`weight_labels`).

``in_flight: "continue-keep-kv"`` skips the preemption: the frozen requests keep their KV blocks
through the load and go on from them (`weight_epoch` keeps later requests off those blocks).

This module reads, from vLLM's output processor in this process, how far each sequence of the
HTTP requests in flight had got when the update stopped it: for the metrics (continued
sequences, tokens prefilled again) and, where the engine reports no versions (vLLM 0.23), for
the spans themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from samrollout.metrics import definitions as m
from samrollout.server.request_state.engine_ids import child_request_id

SequenceKey = tuple[str, int]  # (engine request id the serving layer gave, choice index within it)


@dataclass(frozen=True)
class SequenceProgress:
    """One sequence in flight when an update stopped it: its prompt and the tokens it had generated."""

    prompt_tokens: int
    output_tokens: int


def sequences_in_flight(engine: Any, engine_ids: Iterable[str]) -> dict[SequenceKey, SequenceProgress]:
    """How far each sequence of ``engine_ids`` (vLLM's request ids of HTTP requests in flight) has got.

    Read from vLLM's output processor (its per-sequence states), so it is what the API process
    has received; call it after `drain_outputs`.  A sequence of an ``n > 1`` request is found
    under vLLM's own id and its index, or, where length-aware scheduling fanned the request out,
    under its child's id (`engine_ids.child_request_id`).  Sequences the processor does not
    hold (still waiting for admission in the server, or gone) are left out.
    """
    wanted = set(engine_ids)
    found: dict[SequenceKey, SequenceProgress] = {}
    try:
        states = list(engine.output_processor.request_states.values())
    except AttributeError:
        return found
    for state in states:
        external = str(getattr(state, "external_req_id", None) or getattr(state, "request_id", ""))
        key = sequence_key(external, int(getattr(state, "request_index", 0)), wanted)
        detokenizer = getattr(state, "detokenizer", None)
        if key is None or detokenizer is None:
            continue
        prompt = getattr(state, "prompt_len", None)
        if prompt is None:
            prompt = len(getattr(state, "prompt_token_ids", None) or ())
        found[key] = SequenceProgress(int(prompt), int(detokenizer.num_output_tokens()))
    return found


def sequence_key(external: str, index: int, wanted: set[str]) -> SequenceKey | None:
    """The (request id, choice index) of vLLM's sequence ``index`` of request ``external``, if it is ``wanted``.

    ``external`` is either a request the serving layer made (vLLM fans ``n > 1`` out under the
    same id, ``index`` telling the children apart) or a child length-aware scheduling made, named
    ``{i}_{parent}`` (`engine_ids.child_request_id`) with ``index`` 0.
    """
    if external in wanted:
        return external, index
    head, sep, parent = external.partition("_")
    if sep and head.isdigit() and parent in wanted and child_request_id(parent, int(head)) == external:
        return parent, int(head)
    return None


async def drain_outputs(engine: Any, timeout: float = 2.0) -> None:
    """Wait (at most ``timeout`` s) until the engine outputs received so far reach vLLM's output processor.

    A paused engine sends its last steps' outputs before it answers the pause, but the API
    process's output handler may still hold them in its queue (vLLM's ``pause_generation``
    sleeps 20 ms for this, "not required for correctness"); the counts read after this are then
    the tokens each sequence had when it stopped.
    """
    queue = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
    if queue is None or not hasattr(queue, "empty"):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if queue.empty():
            await asyncio.sleep(0.01)  # the handler may be between two chunks of the last batch it took
            if queue.empty():
                return
        await asyncio.sleep(0.005)


def continued(progress: dict[SequenceKey, SequenceProgress]) -> dict[SequenceKey, SequenceProgress]:
    """The sequences an update continues: those with generated tokens (the others simply start on the new weights)."""
    return {key: p for key, p in progress.items() if p.output_tokens > 0}


def recomputed_tokens(progress: dict[SequenceKey, SequenceProgress]) -> int:
    """The prompt and generated tokens of the continued sequences: what the engine prefills again when their KV
    cache was dropped (at most: siblings' shared prompts may hit the prefix cache)."""
    return sum(p.prompt_tokens + p.output_tokens for p in continued(progress).values())


def count_continued(progress: dict[SequenceKey, SequenceProgress], in_flight: str, *, recomputed: bool) -> None:
    """Metrics: sequences continued across the update, by its ``in_flight`` mode, and (``recomputed``: their KV was
    dropped) their tokens the engine prefills again (`recomputed_tokens`)."""
    sequences = continued(progress)
    if sequences:
        m.CONTINUED_SEQUENCES.labels(in_flight=in_flight).inc(len(sequences))
        if recomputed:
            m.RECOMPUTED_TOKENS.inc(recomputed_tokens(progress))
