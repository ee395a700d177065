"""Starting the server's engine: vLLM's arguments from our settings, the AsyncLLM with SAM, vLLM's serving objects,
and the `ServerRuntime` that holds them.

`start_runtime` turns `ServerSettings` into vLLM's own server arguments (parsed by vLLM's parser, so every vLLM
default applies), builds the AsyncLLM, and lets vLLM initialise its OpenAI serving objects (`init_app_state`)
on the app state; the routes call those objects through the runtime (`runtime`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from starlette.datastructures import State

from samrollout.config import DeviceKind
from samrollout.metrics.definitions import set_scheduling_policy, set_weight_version
from samrollout.metrics.rollouts import RolloutTracker
from samrollout.server.engine.admission import AdmissionScheduler, admission_headroom
from samrollout.server.engine.drafter_stats_cache import EngineActivity
from samrollout.server.engine.length_predictor import LengthPredictor
from samrollout.server.engine.runtime import ServerRuntime
from samrollout.server.engine.scheduled_engine import ScheduledEngineClient, output_tokens_so_far
from samrollout.server.engine.vllm_argv import vllm_argv
from samrollout.server.request_state.queue_limit import QueueLimit
from samrollout.server.settings import ServerSettings, parse_peer_urls, plain_http_peers
from samrollout.server.weights.staging_dir import private_staging_root
from samrollout.server.weights.weight_epoch import EpochSaltedEngine, WeightEpoch
from samrollout.server.weights.weight_labels import WeightLabels, labelling_client
from samrollout.server.weights.weight_peers import WeightPeers, new_server_id
from samrollout.server.weights.weight_uploads import WeightUploads, default_max_bytes, staging_root
from samrollout.server.weights.weights_check import Layout, checkpoint_layout
from samrollout.server.weights.weights_root import WeightsRoot

logger = logging.getLogger("samrollout.server")


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
    from samrollout.server.vllm_compat.vllm_serving import (
        PER_REQUEST_METRICS,
        FlexibleArgumentParser,
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from samrollout.server.vllm_compat.vllm_version import installed_vllm_version

    if settings.per_request_metrics and not PER_REQUEST_METRICS:
        logger.info("per-request metrics are off: vLLM %s has no --enable-per-request-metrics (responses carry "
                    "no `metrics`; /metrics and rollout summaries still count acceptance)", installed_vllm_version())
    parser = make_arg_parser(FlexibleArgumentParser(prog="samrollout serve (vLLM engine flags)"))  # type: ignore[no-untyped-call]
    argv = vllm_argv(settings, model_path, platform_device_kind(), per_request_metrics_flags=PER_REQUEST_METRICS)
    args: argparse.Namespace = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


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
    from samrollout.server.vllm_compat.vllm_serving import init_app_state, set_engine_weight_version

    model_path = resolve_model(settings)
    try:
        weights_root = WeightsRoot(settings.weights_root)
    except ValueError as error:
        raise RuntimeError(str(error)) from None
    layout = checkpoint_layout(model_path) if os.path.isdir(model_path) else None
    uploads = open_weight_uploads(settings, layout)  # before the engine: a bad staging dir fails fast
    warn_of_plain_http_peers(settings)
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
    # What vLLM's serving objects generate with is the engine in three thin layers, each adding one thing to
    # `generate` and passing every other attribute through: the weight epoch's prefix-cache salt and the count
    # of requests reaching the engine (`EpochSaltedEngine`), length-aware admission (`ScheduledEngineClient`,
    # absent under fcfs) and the weight version of each output (`labelling_client`).  Kept as layers rather than
    # one wrapper because each is optional or replaced on its own (fcfs drops admission; tests and
    # bench/http_overhead.py call the salted engine directly) and each has its own tests.
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
                         weights_root=weights_root,
                         weight_peers=WeightPeers(parse_peer_urls(settings.weight_peers), new_server_id(),
                                                  settings.api_key.get_secret_value() if settings.api_key else None,
                                                  settings.weight_upload_idle_seconds),
                         queue=QueueLimit(int(vllm_config.scheduler_config.max_num_seqs),
                                          settings.max_queued_requests))


def warn_of_plain_http_peers(settings: ServerSettings) -> None:
    """Log that the key crosses the network in clear to plain-http peers (allowed by --allow-plain-http-peers)."""
    plain = plain_http_peers(settings.weight_peers) if settings.api_key is not None else []
    if plain:
        logger.warning("weight peers %s are plain http:// (--allow-plain-http-peers): every request to them carries "
                       "the API key in clear; use https:// peers unless the network encrypts or nobody else reads it",
                       ", ".join(plain))


def open_weight_uploads(settings: ServerSettings, layout: Layout | None) -> WeightUploads:
    """The staging area of weights pushed over HTTP, under ``--weight-staging-dir`` (default: ``weight-uploads``
    in the server's cache directory).

    A directory that cannot be created or written, or that is not private to this server (`staging_dir`), stops
    the start with a message naming it.
    """
    root = staging_root(settings.weight_staging_dir)
    max_bytes = settings.max_weight_upload_bytes or default_max_bytes(layout)
    try:
        private_staging_root(root)
        uploads = WeightUploads(root, max_bytes, settings.max_weight_uploads, settings.weight_upload_idle_seconds)
    except OSError as error:
        raise RuntimeError(f"cannot stage weight uploads under {str(root)!r} (--weight-staging-dir): "
                           f"{error.strerror or error}") from None
    logger.info("weight uploads staged under %s (at most %d open, %d bytes each, expiring after %g s idle)",
                uploads.folder, uploads.max_uploads, uploads.max_bytes, uploads.idle_seconds)
    return uploads
