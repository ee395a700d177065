"""The running server's engine and RL state: one AsyncLLM, vLLM's serving objects, the weight version.

`startup.start_runtime` builds it.  The RL operations (weight update, pause, sleep, abort by rollout) live
here so that routes stay thin; what each weight-update mode does is a row of `weights.update_modes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.datastructures import State

from samrollout.metrics import definitions as m
from samrollout.metrics.definitions import set_weight_version
from samrollout.metrics.rollouts import RolloutTracker
from samrollout.server.engine.bounded_call import call_with_deadline
from samrollout.server.engine.continuation import (
    SequenceProgress,
    continued,
    count_continued,
    drain_outputs,
    recomputed_tokens,
    sequences_in_flight,
)
from samrollout.server.engine.drafter_stats_cache import DrafterStatsCache, EngineActivity
from samrollout.server.engine.scheduled_engine import ScheduledEngineClient
from samrollout.server.errors import ApiError
from samrollout.server.request_state.inflight import InflightRegistry
from samrollout.server.request_state.queue_limit import QueueLimit
from samrollout.server.request_state.request_hold import RequestHold
from samrollout.server.settings import ServerSettings
from samrollout.server.weights.commit_outcomes import CommitOutcomes
from samrollout.server.weights.load_holds import hold_at
from samrollout.server.weights.update_modes import update_mode
from samrollout.server.weights.weight_epoch import WeightEpoch
from samrollout.server.weights.weight_labels import WeightLabels
from samrollout.server.weights.weight_peers import WeightPeers
from samrollout.server.weights.weight_uploads import WeightUploads
from samrollout.server.weights.weights_check import (
    FileOutsideRoot,
    Layout,
    WeightsError,
    check_weights_dir,
)
from samrollout.server.weights.weights_root import WeightsRoot, check_path_limits
from samrollout.spec_decode.stats import ProposerStats
from samrollout.vllm_plugins.engine_steps import METHOD
from samrollout_client.protocol.modes import InFlight, PauseMode

logger = logging.getLogger("samrollout.server")
DISCARDED_VERSION = "discarded"  # the version reported while a level-2 sleep's discarded weights are not reloaded

def update_cost(version: str, previous: str, in_flight: InFlight, paused_s: float,
                stopped: dict[tuple[str, int], SequenceProgress]) -> dict[str, Any]:
    """What a weight update did and cost: versions, mode, how long generation was held, and for the modes that
    continue requests, how many sequences went on and how many tokens the engine prefills again."""
    cost: dict[str, Any] = {"weight_version": version, "previous_version": previous, "in_flight": in_flight,
                            "paused_s": round(paused_s, 4)}
    mode = update_mode(in_flight)
    if mode.continues:
        carried = continued(stopped)
        cost["continued_requests"] = len(carried)
        cost["recomputed_tokens"] = recomputed_tokens(stopped) if mode.preempts else 0
    return cost


@dataclass
class ServerRuntime:
    """Everything a route needs: the engine, vLLM's serving objects, and the RL state."""

    settings: ServerSettings
    engine: Any                      # vllm.v1.engine.async_llm.AsyncLLM
    generation: Any                  # what vLLM's serving objects generate with: the engine, or ScheduledEngineClient
    state: State                     # the app state vLLM's init_app_state filled
    model_name: str
    vocab_size: int
    max_model_len: int
    weight_version: str
    rollouts: RolloutTracker
    weight_uploads: WeightUploads    # weights pushed over HTTP, staged until committed (/admin/weight_uploads)
    queue: QueueLimit                # sequences in progress, bounded (--max-queued-requests; 429 beyond)
    weight_peers: WeightPeers        # the servers this one relays pushed weight files to (--weight-peers)
    inflight: InflightRegistry = field(default_factory=InflightRegistry)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    expected_weights: Layout | None = None  # the served checkpoint's tensors: what weight updates must match
    sleep_level: int | None = None           # set by /admin/sleep, cleared by /admin/wake (pausing is not sleep)
    weights_discarded: bool = False          # a level-2 sleep discarded the weights; cleared by the next load
    paused: bool = False                     # the engine's scheduler paused (pause/resume, sleep/wake): for status
    labels: WeightLabels | None = None       # which weight version produced each sequence (weight_labels)
    epoch: WeightEpoch = field(default_factory=WeightEpoch)  # prefix-cache salt by weight load (weight_epoch)
    last_update: dict[str, Any] | None = None  # the last weight update's `update_cost`, with its Unix time ("at")
    generation_gate: RequestHold | None = None  # AReaL's pause holds new requests here (--areal-routes; set by the app)
    weights_root: WeightsRoot = field(default_factory=lambda: WeightsRoot(None))  # where loads by path may read
    activity: EngineActivity | None = None   # requests reaching the engine (drafter_stats_cache); None: count none
    commit_outcomes: CommitOutcomes = field(default_factory=CommitOutcomes)  # each upload commit's end, by upload id

    def __post_init__(self) -> None:
        """Label sequences the engine gives no version with this runtime's version (`weight_labels`)."""
        if self.labels is None:
            self.labels = WeightLabels(self.engine, lambda: self.weight_version)
        self.labels.current = lambda: self.weight_version
        self._drafter_cache = DrafterStatsCache(self._read_drafter_stats, self.activity or EngineActivity(None))

    async def abort_rollout(self, rollout_id: str) -> int:
        """Abort every in-flight request tagged ``rollout_id``; returns how many HTTP requests it hit."""
        requests = self.inflight.of_rollout(rollout_id)
        ids = self.inflight.engine_ids(requests)
        if ids:
            await self.generation.abort(ids)
        return len(requests)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Pause generation; with mode "abort", sequences still waiting for admission end too."""
        from samrollout.server.vllm_compat.vllm_serving import pause_engine

        if mode == "abort" and isinstance(self.generation, ScheduledEngineClient):
            self.generation.abort_all_waiting()
        await pause_engine(self.engine, mode=mode, clear_cache=clear_cache)
        self.paused = True

    async def resume(self) -> None:
        """Resume generation after `pause`; waits for a weight load under way (the update lock), so the engine never
        steps while weights are swapped."""
        async with self.update_lock:
            await self._resume_engine()

    async def resume_unless_sleeping(self) -> None:
        """`resume` when generation is paused and the engine is not asleep (AReaL's continue), under the update lock."""
        async with self.update_lock:
            if self.paused and self.sleep_level is None:
                await self._resume_engine()

    async def _resume_engine(self) -> None:
        """Let the engine step again (the caller holds the update lock)."""
        await self.engine.resume_generation()
        self.paused = False

    async def sleep(self, level: int) -> None:
        """Free accelerator memory (vLLM sleep mode, level 1 or 2); 409 when the server runs without sleep mode.

        Level 2 discards the weights: that is recorded before the engine is asked, and generation is refused
        (`need_weights`) until weights are loaded again, whatever wake does.  Taken under the update lock.
        """
        self._need_sleep_mode()
        async with self.update_lock:
            if level >= 2:
                self.weights_discarded = True
            await self.engine.sleep(level)
            self.sleep_level = level
            self.paused = True  # the engine pauses its scheduler to sleep

    async def wake(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed: all of it, or only the ``tags`` named (vLLM's "weights", "kv_cache").

        After a level-2 sleep the weights' memory comes back but not their values: generation stays refused
        until a weight load (`need_weights`).  Taken under the update lock.
        """
        self._need_sleep_mode()
        async with self.update_lock:
            await self.engine.wake_up(tags)
            if not tags or {"weights", "kv_cache"} <= set(tags):
                self.sleep_level = None
                self.paused = False  # a full wake resumes the engine's scheduler, even after a pause

    @property
    def served_version(self) -> str:
        """The weight version as reported (/admin/status, identity, peers): `DISCARDED_VERSION` after a level-2
        sleep until weights are loaded again."""
        return DISCARDED_VERSION if self.weights_discarded else self.weight_version

    def need_weights(self) -> None:
        """ApiError 503 while the weights are discarded (a level-2 sleep, no load since): nothing is generated."""
        if self.weights_discarded:
            raise ApiError(503, f"no weights are loaded: a level-2 sleep discarded version {self.weight_version!r}; "
                           "load weights (POST /admin/update_weights or a weight upload's commit) before generating")

    def _need_sleep_mode(self) -> None:
        if not self.state.vllm_config.model_config.enable_sleep_mode:
            raise ApiError(409, "sleep mode is off: start the server with `-- --enable-sleep-mode` (CUDA or NPU only)")

    async def run_steps(self, steps: int) -> int:
        """Run the held engine ``steps`` model steps and hold it again ("keep"); the steps it ran (`engine_steps`).

        Taken under the update lock, so stepping never lets an update's held engine run.
        """
        async with self.update_lock:
            try:
                ran = await self.engine.engine_core.call_utility_async(METHOD, steps)
            except Exception as exc:
                if f"has no attribute '{METHOD}'" not in str(exc):  # vLLM names every failed call's method
                    raise
                raise ApiError(501, f"this vLLM cannot step a held engine ({exc})") from exc  # the plugin did not load
        self.paused = True
        return int(ran)

    def scheduling_status(self) -> dict[str, Any]:
        """The rollout scheduling policy and, under length-aware, its queue (for /admin/status)."""
        status: dict[str, Any] = {"policy": self.settings.rollout_scheduling}
        if isinstance(self.generation, ScheduledEngineClient):
            status.update(self.generation.scheduler.status())
        return status

    async def update_weights(self, path: str, version: str, in_flight: InFlight, param: str = "path") -> dict[str, Any]:
        """Load new policy weights from the directory a client named (``POST /admin/update_weights``, AReaL's
        ``/areal_update_weights``): confined to ``--weights-root`` (`weights_root`: 403 outside it, the request field
        ``param`` named), then `load_weights`.  The path is capped first (`check_path_limits`) and resolved off the
        event loop, bounded by --weight-check-timeout, so no path a caller names can hold other requests."""
        check_path_limits(path, param)
        limit = self.settings.weight_check_timeout
        try:
            folder = await call_with_deadline(self.weights_root.confine, path, param, timeout=limit,
                                              name="samrollout-weights-path")
        except TimeoutError:
            raise ApiError(400, f"weights not loaded: resolving {param} took over {limit:g} s "
                           "(--weight-check-timeout); the served weights are kept", param) from None
        return await self.load_weights(folder, version, in_flight, param=param, source=path,
                                       allowed=self.weights_root.holds if self.weights_root.root else None)

    async def load_weights(self, path: str, version: str, in_flight: InFlight, *, param: str | None,
                           source: str, allowed: Callable[[Path], bool] | None = None) -> dict[str, Any]:
        """Load new policy weights from the directory ``path`` between steps and serve them as ``version``.

        The one load path of both a directory the server reads (``update_weights``) and a
        committed upload (``/admin/weight_uploads``).  The files are checked first
        (`weights_check`): a bad directory is a 400 naming the file and tensor (``param``:
        the request field it came from), and the engine never sees it.  Then generation is
        paused: in-flight requests either finish on the old weights ("wait"), are aborted
        ("abort"), or stop at a token boundary and go on under the new weights once they are
        loaded, within the same response, their keys and values computed again ("continue",
        `continuation`) or kept ("continue-keep-kv"); requests arriving meanwhile queue and run
        on the new weights.  The drafters' automata are dropped, since the old policy built them.
        Every mode but "continue-keep-kv" also drops the prefix cache and zeroes the KV cache: a
        NaN that bad weights left in a cache block would otherwise poison every later request
        placed there, whatever weights follow; "continue-keep-kv" keeps both, and the new weight
        epoch keeps later requests off the old blocks (`weight_epoch`).  ``source`` says where the
        weights came from, for the log; ``allowed``: where each weight file must resolve (a 403 otherwise).
        The result (also `last_update`) says what the update cost.
        """
        folder = await self._checked_weights(path, param, allowed)
        mode = update_mode(in_flight)
        async with self.update_lock:
            old = self.weight_version
            held = time.monotonic()
            await self.pause(mode.pause, clear_cache=not mode.keeps_kv)
            self.epoch.advance()  # what reaches the engine from now on is computed under the new weights
            stopped: dict[tuple[str, int], SequenceProgress] = {}
            try:
                stopped = await self._stop_in_flight(in_flight)
                await self._swap_weights(folder, version, keep_kv=mode.keeps_kv)
                if self.labels is not None:  # spans where the engine keeps no version (weight_labels)
                    self.labels.continued({key: p.output_tokens for key, p in stopped.items()}, old, version)
                count_continued(stopped, in_flight, recomputed=mode.preempts)
            finally:
                await self._resume_engine()
                paused = time.monotonic() - held
                m.WEIGHT_UPDATE_PAUSE.labels(in_flight=in_flight).observe(paused)
        cost = update_cost(version, old, in_flight, paused, stopped)
        self.last_update = {**cost, "at": round(time.time(), 3)}
        logger.info("weights %s -> %s loaded from %s (in-flight: %s; generation held %.3f s%s)", old, version, source,
                    in_flight, paused, f", {cost['continued_requests']} sequences continued"
                    if mode.continues else "")
        return cost

    async def _stop_in_flight(self, in_flight: InFlight) -> dict[tuple[str, int], SequenceProgress]:
        """Once paused for an update: how far each sequence of the HTTP requests in flight had got
        (`continuation.sequences_in_flight`), for the modes that continue them ("wait" and "abort" left none).

        "continue-keep-kv" leaves them holding their KV blocks, frozen at a step boundary by the
        pause.  "continue" preempts every running request first: its KV blocks are freed, before the
        reload zeroes the cache, and it goes back to the head of the engine's queue with its prompt
        and generated tokens, recomputed under the new weights on resume (`continuation`).  vLLM
        0.23-0.33 already preempt them when the pause clears the cache; this says it rather than
        assuming it, and also covers requests that an earlier ``/admin/pause`` (which keeps the
        cache) froze.  Sequences still waiting for admission (length-aware scheduling) stay queued
        and simply start on the new weights.
        """
        mode = update_mode(in_flight)
        if not mode.continues:
            return {}
        if mode.preempts:
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        await drain_outputs(self.engine)
        return sequences_in_flight(self.engine, self.inflight.engine_ids())

    async def _swap_weights(self, folder: Path, version: str, *, keep_kv: bool) -> None:
        """Load the checked weights in ``folder`` into the paused engine and serve them as ``version``.

        Unless ``keep_kv``, the KV cache is zeroed (not while the engine sleeps: its memory is
        released then) and the prefix cache dropped.  The drafters start again either way.
        """
        from samrollout.server.vllm_compat.vllm_serving import set_engine_weight_version

        await hold_at("swap")  # testing only (load_holds)
        await self.engine.collective_rpc("samrollout_reload_weights", kwargs={
            "weights_path": str(folder), "clear_kv_cache": not keep_kv and self.sleep_level is None})
        if not keep_kv:
            await self.engine.reset_prefix_cache()
        await self.engine.collective_rpc("samrollout_reset_drafter")
        self._drafter_cache.forget()
        old = self.weight_version
        self.weight_version = version
        self.weights_discarded = False  # weights are loaded again (after a level-2 sleep)
        set_weight_version(version, old)
        await set_engine_weight_version(self.engine, version)

    async def _checked_weights(self, path: str, param: str | None, allowed: Callable[[Path], bool] | None) -> Path:
        """The directory ``path`` once its files passed `check_weights_dir` (file IO off the event loop, in its own
        thread, bounded by --weight-check-timeout); a 400 naming ``param`` otherwise (403 for a file outside
        ``allowed``), the served weights kept."""
        limit = self.settings.weight_check_timeout
        await hold_at("check")  # testing only (load_holds)
        try:
            return await call_with_deadline(check_weights_dir, path, self.expected_weights,
                                            self.settings.weight_value_check, allowed, timeout=limit,
                                            name="samrollout-weights-check")
        except FileOutsideRoot as error:
            raise ApiError(403, f"weights not loaded: {error}", param) from None
        except WeightsError as error:
            raise ApiError(400, f"weights not loaded: {error}", param) from None
        except TimeoutError:
            raise ApiError(400, f"weights not loaded: reading the files took over {limit:g} s "
                           "(--weight-check-timeout); the served weights are kept", param) from None

    async def drafter_stats(self) -> ProposerStats | None:
        """The proposer's stats (`SamProposer.stats`) of the first worker; None with speculation off. Read from the
        worker only when the engine may have stepped since the last read (`drafter_stats_cache`)."""
        return await self._drafter_cache.get()

    async def _read_drafter_stats(self) -> ProposerStats | None:
        """The proposer's stats, asked of the first worker.

        With tensor parallelism every rank runs the same proposer on the same batch, so
        one rank's counters are the engine's.  They cross from the worker as JSON, read back
        strictly (`ProposerStats.from_json`: a missing or unknown key is an error, not a zero).
        """
        replies = await self.engine.collective_rpc("samrollout_drafter_stats")
        first: dict[str, Any] | None = replies[0] if replies else None
        return None if first is None else ProposerStats.from_json(first)
