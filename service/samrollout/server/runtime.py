"""The running server's engine and RL state: one AsyncLLM, vLLM's serving objects, the weight version.

`start_runtime` turns `ServerSettings` into vLLM's own server arguments (parsed by vLLM's
parser, so every vLLM default applies), builds the AsyncLLM with SAM, and lets vLLM
initialise its OpenAI serving objects (`init_app_state`) on the app state; our routes
call those objects.  The RL operations (weight update, pause, abort by rollout) live here
so that routes stay thin.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.datastructures import State

from samrollout.config import DeviceKind
from samrollout.engine_steps import METHOD
from samrollout.metrics import definitions as m
from samrollout.metrics.definitions import set_scheduling_policy, set_weight_version
from samrollout.metrics.rollouts import RolloutTracker
from samrollout.server.admission import AdmissionScheduler, admission_headroom
from samrollout.server.bounded_call import call_with_deadline
from samrollout.server.continuation import (
    SequenceProgress,
    continued,
    count_continued,
    drain_outputs,
    recomputed_tokens,
    sequences_in_flight,
)
from samrollout.server.drafter_stats_cache import DrafterStatsCache, EngineActivity
from samrollout.server.errors import ApiError
from samrollout.server.generation_gate import GenerationGate
from samrollout.server.inflight import InflightRegistry
from samrollout.server.length_predictor import LengthPredictor
from samrollout.server.queue_limit import QueueLimit
from samrollout.server.scheduled_engine import ScheduledEngineClient, output_tokens_so_far
from samrollout.server.settings import ServerSettings, parse_peer_urls
from samrollout.server.update_modes import update_mode
from samrollout.server.vllm_argv import vllm_argv
from samrollout.server.weight_epoch import EpochSaltedEngine, WeightEpoch
from samrollout.server.weight_labels import WeightLabels, labelling_client
from samrollout.server.weight_peers import WeightPeers, new_server_id
from samrollout.server.weight_uploads import WeightUploads, default_max_bytes, default_staging_root
from samrollout.server.weights_check import (
    FileOutsideRoot,
    Layout,
    WeightsError,
    check_weights_dir,
    checkpoint_layout,
)
from samrollout.server.weights_root import WeightsRoot
from samrollout.spec_decode.stats import ProposerStats
from samrollout_client.protocol.modes import InFlight, PauseMode

logger = logging.getLogger("samrollout.server")

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


def resolve_model(settings: ServerSettings) -> str:
    """The model path to load: the configured one, or the built-in SmolLM2 (converted on first run)."""
    if settings.model is not None:
        return settings.model
    from samrollout.models import ensure_smollm2

    print("samrollout: using the built-in model SmolLM2-135M-Instruct (converted once, then cached)",
          file=sys.stderr, flush=True)
    return str(ensure_smollm2())


def platform_device_kind() -> DeviceKind:
    """What vLLM's platform runs the engine on: CUDA GPUs, CPUs, or else (Ascend NPUs) "npu"."""
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda() else "cpu" if current_platform.is_cpu() else "npu"


def vllm_namespace(settings: ServerSettings, model_path: str) -> argparse.Namespace:
    """vLLM's server arguments for our settings, parsed and validated by vLLM itself."""
    from samrollout.server.vllm_serving import (
        PER_REQUEST_METRICS,
        FlexibleArgumentParser,
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from samrollout.server.vllm_version import installed_vllm_version

    if settings.per_request_metrics and not PER_REQUEST_METRICS:
        logger.info("per-request metrics are off: vLLM %s has no --enable-per-request-metrics (responses carry "
                    "no `metrics`; /metrics and rollout summaries still count acceptance)", installed_vllm_version())
    parser = make_arg_parser(FlexibleArgumentParser(prog="samrollout serve (vLLM engine flags)"))  # type: ignore[no-untyped-call]
    argv = vllm_argv(settings, model_path, platform_device_kind(), per_request_metrics_flags=PER_REQUEST_METRICS)
    args: argparse.Namespace = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


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
    paused: bool = False                     # the engine's scheduler paused (pause/resume, sleep/wake): for status
    labels: WeightLabels | None = None       # which weight version produced each sequence (weight_labels)
    epoch: WeightEpoch = field(default_factory=WeightEpoch)  # prefix-cache salt by weight load (weight_epoch)
    last_update: dict[str, Any] | None = None  # the last weight update's `update_cost`, with its Unix time ("at")
    generation_gate: GenerationGate | None = None  # AReaL's pause holds new requests here (--areal-routes)
    weights_root: WeightsRoot = field(default_factory=lambda: WeightsRoot(None))  # where loads by path may read
    activity: EngineActivity | None = None   # requests reaching the engine (drafter_stats_cache); None: count none

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
        from samrollout.server.vllm_serving import pause_engine

        if mode == "abort" and isinstance(self.generation, ScheduledEngineClient):
            self.generation.abort_all_waiting()
        await pause_engine(self.engine, mode=mode, clear_cache=clear_cache)
        self.paused = True

    async def resume(self) -> None:
        """Resume generation after `pause`."""
        await self.engine.resume_generation()
        self.paused = False

    async def sleep(self, level: int) -> None:
        """Free accelerator memory (vLLM sleep mode, level 1 or 2); 409 when the server runs without sleep mode."""
        self._need_sleep_mode()
        await self.engine.sleep(level)
        self.sleep_level = level
        self.paused = True  # the engine pauses its scheduler to sleep

    async def wake(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed: all of it, or only the ``tags`` named (vLLM's "weights", "kv_cache")."""
        self._need_sleep_mode()
        await self.engine.wake_up(tags)
        if not tags or {"weights", "kv_cache"} <= set(tags):
            self.sleep_level = None
            self.paused = False  # a full wake resumes the engine's scheduler, even after a pause

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
        ``param`` named), then `load_weights`."""
        folder = self.weights_root.confine(path, param)
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
                count_continued(stopped, recomputed=mode.preempts)
            finally:
                await self.resume()
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
        from samrollout.server.vllm_serving import set_engine_weight_version

        await self.engine.collective_rpc("samrollout_reload_weights", kwargs={
            "weights_path": str(folder), "clear_kv_cache": not keep_kv and self.sleep_level is None})
        if not keep_kv:
            await self.engine.reset_prefix_cache()
        await self.engine.collective_rpc("samrollout_reset_drafter")
        self._drafter_cache.forget()
        old = self.weight_version
        self.weight_version = version
        set_weight_version(version, old)
        await set_engine_weight_version(self.engine, version)

    async def _checked_weights(self, path: str, param: str | None, allowed: Callable[[Path], bool] | None) -> Path:
        """The directory ``path`` once its files passed `check_weights_dir` (file IO off the event loop, in its own
        thread, bounded by --weight-check-timeout); a 400 naming ``param`` otherwise (403 for a file outside
        ``allowed``), the served weights kept."""
        limit = self.settings.weight_check_timeout
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


def build_engine(settings: ServerSettings, model_path: str) -> tuple[Any, argparse.Namespace]:
    """The AsyncLLM `samrollout serve` runs for ``settings`` and vLLM's parsed server arguments.

    `bench/http_overhead.py` builds its direct-to-engine path with this too, so that both
    paths run one engine configuration.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from samrollout.cpu_defaults import place_cpu_worker_threads
    from samrollout.metrics.engine_stats import SamStatLogger

    if current_platform.is_cpu():
        place_cpu_worker_threads()
    args = vllm_namespace(settings, model_path)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    engine = AsyncLLM.from_vllm_config(vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
                                       enable_log_requests=engine_args.enable_log_requests,
                                       disable_log_stats=engine_args.disable_log_stats,
                                       stat_loggers=[SamStatLogger])
    return engine, args


def generation_client(settings: ServerSettings, engine: Any) -> Any:
    """The engine client vLLM's serving objects call: ``engine`` itself (fcfs) or length-aware admission to it."""
    set_scheduling_policy(settings.rollout_scheduling)
    if settings.rollout_scheduling == "fcfs":
        return engine
    slots = int(engine.vllm_config.scheduler_config.max_num_seqs)
    capacity = slots + admission_headroom(slots)
    scheduler = AdmissionScheduler(capacity, LengthPredictor(settings.scheduling_history),
                                   lambda request_id: output_tokens_so_far(engine, request_id))
    logger.info("length-aware rollout scheduling: at most %d sequences in the engine (%d slots), probes first, "
                "then the longest predicted groups", capacity, slots)
    return ScheduledEngineClient(engine, scheduler)


async def start_runtime(settings: ServerSettings, state: State) -> ServerRuntime:
    """Build the engine and vLLM's serving objects for ``settings`` (tens of seconds on CPU)."""
    from samrollout.server.vllm_serving import init_app_state, set_engine_weight_version

    model_path = resolve_model(settings)
    try:
        weights_root = WeightsRoot(settings.weights_root)
    except ValueError as error:
        raise RuntimeError(str(error)) from None
    layout = checkpoint_layout(model_path) if os.path.isdir(model_path) else None
    uploads = open_weight_uploads(settings, layout)  # before the engine: a bad staging dir fails fast
    try:
        engine, args = build_engine(settings, model_path)
    except BaseException:
        uploads.close()
        raise
    vllm_config = engine.vllm_config
    if layout is None:  # a hub id: the engine has downloaded it now
        layout = checkpoint_layout(model_path, vllm_config.model_config.revision, vllm_config.load_config.download_dir)
        if layout is not None and settings.max_weight_upload_bytes is None:
            uploads.max_bytes = default_max_bytes(layout)
    epoch, activity = WeightEpoch(), EngineActivity(engine)
    generation = generation_client(settings, EpochSaltedEngine(engine, epoch, activity.note_request))
    labels = WeightLabels(engine, lambda: settings.weight_version)  # then the runtime's (its __post_init__)
    try:
        supported = await engine.get_supported_tasks()
        await init_app_state(labelling_client(generation, labels), state, args, supported)
        await set_engine_weight_version(engine, settings.weight_version)
        set_weight_version(settings.weight_version)
    except BaseException:
        engine.shutdown()
        uploads.close()
        raise
    model_config = vllm_config.model_config
    return ServerRuntime(settings=settings, engine=engine, generation=generation, state=state,
                         model_name=settings.public_model_name(model_path),
                         vocab_size=int(model_config.get_vocab_size()),
                         max_model_len=int(model_config.max_model_len),
                         weight_version=settings.weight_version,
                         expected_weights=layout,
                         rollouts=RolloutTracker(settings.threshold, settings.rollout_idle_seconds),
                         weight_uploads=uploads, labels=labels, epoch=epoch, activity=activity,
                         generation_gate=GenerationGate() if settings.areal_routes else None,
                         weights_root=weights_root,
                         weight_peers=WeightPeers(parse_peer_urls(settings.weight_peers), new_server_id(),
                                                  settings.api_key.get_secret_value() if settings.api_key else None,
                                                  settings.weight_upload_idle_seconds),
                         queue=QueueLimit(int(vllm_config.scheduler_config.max_num_seqs),
                                          settings.max_queued_requests))


def open_weight_uploads(settings: ServerSettings, layout: Layout | None) -> WeightUploads:
    """The staging area of weights pushed over HTTP, under ``--weight-staging-dir`` (default: the system temp dir).

    A directory that cannot be created or written stops the start with a message naming it.
    """
    root = Path(settings.weight_staging_dir) if settings.weight_staging_dir else default_staging_root()
    max_bytes = settings.max_weight_upload_bytes or default_max_bytes(layout)
    try:
        uploads = WeightUploads(root, max_bytes, settings.max_weight_uploads, settings.weight_upload_idle_seconds)
    except OSError as error:
        raise RuntimeError(f"cannot stage weight uploads under {str(root)!r} (--weight-staging-dir): "
                           f"{error.strerror or error}") from None
    logger.info("weight uploads staged under %s (at most %d open, %d bytes each, expiring after %g s idle)",
                uploads.folder, uploads.max_uploads, uploads.max_bytes, uploads.idle_seconds)
    return uploads
