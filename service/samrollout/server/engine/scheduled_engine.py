"""The engine client vLLM's serving layer calls under length-aware scheduling.

It is the AsyncLLM with one method changed: `generate` queues each sequence in the
`AdmissionScheduler` and hands it to the engine when admitted.  A request with ``n > 1``
is fanned out here into ``n`` requests with ``n = 1`` (child ``i`` gets ``seed + i``, as
vLLM's own fan-out does, and the children stay one drafting group), because vLLM gives all
children of one request a single priority and admission time, and length-aware scheduling
must start the probe before its siblings.  Their outputs are merged back into what vLLM
would have returned: one final output with ``n`` completions, or streamed deltas indexed
by child.  Everything else (`abort`, pause, health, weights) goes to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterable
from copy import copy
from typing import Any

from samrollout.config import GROUP_FIELD
from samrollout.server.engine.admission import AdmissionScheduler
from samrollout.server.engine.length_predictor import prompt_key
from samrollout.server.request_state.engine_ids import child_request_id
from samrollout_client.protocol.prompt_identity import sibling_group


def output_tokens_so_far(engine: Any, request_id: str) -> int:
    """Tokens the engine has generated for ``request_id`` so far (0 if it is not known).

    Read from vLLM's output processor in this process (its per-request detokenizer state),
    so it costs no call to the engine core.
    """
    try:
        processor = engine.output_processor
        internal = processor.external_req_ids.get(request_id) or [request_id]
        return max((int(processor.request_states[i].detokenizer.num_output_tokens())
                    for i in internal if i in processor.request_states), default=0)
    except (AttributeError, KeyError, TypeError):
        return 0


def _prompt_token_ids(prompt: Any) -> list[int] | None:
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else getattr(prompt, "prompt_token_ids", None)
    return list(ids) if isinstance(ids, list) else None


class ScheduledEngineClient:
    """The engine as vLLM's serving objects see it, with `generate` going through admission."""

    def __init__(self, engine: Any, scheduler: AdmissionScheduler) -> None:
        self._engine = engine
        self.scheduler = scheduler
        self._children: dict[str, list[str]] = {}  # parent id -> its fanned-out child ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests by the ids the serving layer gave them: waiting ones end unadmitted."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.scheduler.abort_waiting(ids)
        ids += [child for i in list(ids) for child in self._children.get(i, [])]
        if internal:
            await self._engine.abort(ids, internal)
        else:
            await self._engine.abort(ids)

    def abort_all_waiting(self) -> int:
        """End every waiting sequence unadmitted (pause with mode=abort); returns how many."""
        return self.scheduler.abort_waiting()

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        """vLLM's `generate`, each sequence admitted by the scheduler; ``n > 1`` fanned out and merged."""
        extra = getattr(sampling_params, "extra_args", None) or {}
        group = str(extra.get(GROUP_FIELD) or sibling_group(request_id))
        prompt_id = prompt_key(_prompt_token_ids(prompt), group)
        if sampling_params.n == 1:
            async for out in self._sequence(prompt, sampling_params, request_id, request_id, group, prompt_id,
                                            kwargs):
                yield out
            return
        async for out in self._fan_out(prompt, sampling_params, request_id, group, prompt_id, kwargs):
            yield out

    async def _sequence(self, prompt: Any, params: Any, child_id: str, parent_id: str, group: str,
                        prompt_id: str, kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """One n = 1 sequence: wait for admission, then run it in the engine."""
        from vllm.sampling_params import RequestOutputKind

        entry = self.scheduler.enqueue(child_id, parent_id, group, prompt_id)
        try:
            admitted = await entry.admitted
        except asyncio.CancelledError:
            self.scheduler.withdraw(entry)
            raise
        if not admitted:
            yield _aborted_output(child_id, prompt, params)
            return
        delta = params.output_kind == RequestOutputKind.DELTA
        tokens, finish = 0, None
        try:
            async for out in self._engine.generate(prompt, params, child_id, **kwargs):
                produced = len(out.outputs[0].token_ids) if out.outputs else 0
                tokens = tokens + produced if delta else produced
                finish = out.outputs[0].finish_reason if out.outputs else finish
                yield out
        finally:
            # A sequence cut short (client gone, abort) still shows its group is at least this long.
            ended_by_itself = finish is not None and finish != "abort"
            self.scheduler.done(entry, tokens if ended_by_itself or tokens > 0 else None)

    async def _fan_out(self, prompt: Any, params: Any, request_id: str, group: str, prompt_id: str,
                       kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """``n`` sequences, merged back into the outputs of one request."""
        from vllm.sampling_params import RequestOutputKind

        n = params.n
        child_ids = [child_request_id(request_id, i) for i in range(n)]
        self._children[request_id] = child_ids
        queue: asyncio.Queue[tuple[int, Any] | BaseException] = asyncio.Queue()

        async def run(index: int) -> None:
            child = copy(params)
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + index
            child.extra_args = {**(params.extra_args or {}), GROUP_FIELD: group}
            try:
                async for out in self._sequence(prompt, child, child_ids[index], request_id, group, prompt_id,
                                                kwargs):
                    queue.put_nowait((index, out))
            except Exception as error:  # handed to the consumer, which re-raises it
                queue.put_nowait(error)

        tasks = [asyncio.create_task(run(i)) for i in range(n)]
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        finals: dict[int, Any] = {}
        try:
            while len(finals) < n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, out = item
                for completion in out.outputs:
                    completion.index = index
                if out.finished:
                    finals[index] = out
                if not final_only:
                    out.request_id, out.finished = request_id, len(finals) == n
                    yield out
            if final_only:
                first = finals[0]
                first.request_id, first.finished = request_id, True
                first.outputs = [finals[i].outputs[0] for i in range(n) if finals[i].outputs]
                yield first
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
            self._children.pop(request_id, None)


def _aborted_output(request_id: str, prompt: Any, params: Any) -> Any:
    """What vLLM returns for a request aborted before it produced anything: no tokens, finish reason abort."""
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                  logprobs=[] if params.logprobs is not None else None, finish_reason="abort")
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=_prompt_token_ids(prompt),
                         prompt_logprobs=None, outputs=[completion], finished=True)
