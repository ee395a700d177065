"""Runs the server's code on another vLLM release's real Python, with a stand-in engine, and reports what happened.

The engines of vLLM 0.23 (vllm-ascend's; its compiled ops need torch 2.11) and vLLM 0.33 (a CUDA
build) cannot run here, but their Python can: tests/test_vllm023_serving_contract.py and
tests/test_vllm033_serving_contract.py start this script in a subprocess whose ``sys.path``
puts the release's source (and a ``vllm <version>+cpu`` metadata stub, so vLLM picks its CPU
platform) before the installed vLLM 0.32 (tests/support/vllm_contract.py, `run_probe`).  Everything
from vLLM is then that release's: the server chooses its layout, vLLM parses and validates the
settings' flags and builds the engine config, ``init_app_state`` builds the OpenAI serving
objects, and requests go through the release's serving code to a stand-in ``AsyncLLM`` that
checks every call against the real ``AsyncLLM``'s signatures.  Each check's result is written
to a JSON file: ``{name: {"ok": true, ...data} | {"ok": false, "error": traceback}}``.

Usage: ``python vllm_probe.py MODEL_DIR OUT_JSON``
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

API_KEY = "probe-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS = [11, 12, 13]  # what the stand-in engine "generates" for every sequence


class LogLines(logging.Handler):
    """Collects the messages of one logger."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        logger = logging.getLogger(name)
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _version() -> str:
    import vllm

    version: str = vllm.__version__
    return version


def _generation_error() -> type[Exception]:
    """vLLM's GenerationError (in ``vllm.exceptions`` since 0.32; the OpenAI protocol module's in 0.23)."""
    import vllm.exceptions

    error = getattr(vllm.exceptions, "GenerationError", None)
    if error is None:
        from vllm.entrypoints.openai.engine.protocol import GenerationError as error
    assert isinstance(error, type) and issubclass(error, Exception)
    return error


def check_layout(model_dir: str) -> dict[str, Any]:
    import vllm

    from samrollout.server.vllm_compat import vllm_serving
    from samrollout.server.vllm_compat.vllm_version import serving_series

    return {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__, "series": serving_series(),
            "init_app_state": vllm_serving.init_app_state.__module__,
            "completion_request": vllm_serving.CompletionRequest.__module__,
            "per_request_metrics": vllm_serving.PER_REQUEST_METRICS,
            "error_types": [f"{t.__module__}.{t.__qualname__}" for t in vllm_serving.ERROR_TYPES]}


NAMESPACE_FIELDS = ("model", "served_model_name", "seed", "dtype", "tensor_parallel_size", "gpu_memory_utilization",
                    "worker_extension_cls", "max_model_len", "enable_chunked_prefill", "max_num_seqs",
                    "speculative_config", "additional_config", "enforce_eager", "enable_sleep_mode")


def check_flags(model_dir: str) -> dict[str, Any]:
    """The settings' flags through the release's own parser and validation (`startup.vllm_namespace`)."""
    from samrollout.server.engine.startup import platform_device_kind, vllm_namespace
    from samrollout.server.engine.vllm_argv import vllm_argv
    from samrollout.server.settings import ServerSettings
    from samrollout.server.vllm_compat.vllm_serving import PER_REQUEST_METRICS, FlexibleArgumentParser, make_arg_parser

    variants = {
        "default": ServerSettings(model=model_dir),
        "everything": ServerSettings(model=model_dir, served_model_name="tiny", speculation=False,
                                     chunked_prefill=False, max_model_len=512, max_num_seqs=4,
                                     gpu_memory_utilization=0.5, dtype="float32", seed=3,
                                     per_request_metrics=True,
                                     vllm_args=["--enforce-eager", "--enable-sleep-mode"]),
        "chunked": ServerSettings(model=model_dir, chunked_prefill=True, per_request_metrics=False),
    }
    result: dict[str, Any] = {}
    for name, settings in variants.items():
        log = LogLines("samrollout.server")
        namespace = vllm_namespace(settings, model_dir)
        logging.getLogger("samrollout.server").removeHandler(log)
        result[name] = {"namespace": {f: _jsonable(getattr(namespace, f)) for f in NAMESPACE_FIELDS},
                        "log": log.lines, "argv": vllm_argv(settings, model_dir, platform_device_kind(),
                                                            per_request_metrics_flags=PER_REQUEST_METRICS)}
    parser = make_arg_parser(FlexibleArgumentParser())
    rejected = {}
    for flag in (["--enable-per-request-metrics"], ["--per-request-spec-decode-metrics", "summary"]):
        try:
            parser.parse_args(["--model", model_dir, *flag])
            rejected[flag[0]] = False
        except SystemExit:
            rejected[flag[0]] = True
    result["per_request_flags_rejected"] = rejected
    return result


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _engine_config(model_dir: str, speculative_config: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(engine args, engine config) as start_runtime builds them; ``speculative_config`` replaces the settings'."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from samrollout.server.engine.startup import vllm_namespace
    from samrollout.server.settings import ServerSettings

    args = vllm_namespace(ServerSettings(model=model_dir, max_model_len=512), model_dir)
    if speculative_config is not None:
        args.speculative_config = speculative_config
    engine_args = AsyncEngineArgs.from_cli_args(args)
    return engine_args, engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def check_engine_config(model_dir: str) -> dict[str, Any]:
    """The release builds the engine config from the settings' flags as start_runtime does.

    Also: whether the settings hand vLLM the static threshold as its batch-size schedule
    (`samrollout.spec_decode.schedule`), and whether the release keeps such a schedule for a
    ``custom_class`` proposer when one is passed.
    """
    from vllm.config import SpeculativeConfig

    from samrollout.spec_decode.schedule import SCHEDULE_FIELD, range_schedule, vllm_has_batch_size_schedule

    engine_args, config = _engine_config(model_dir)
    spec = config.speculative_config
    kept = None
    if SCHEDULE_FIELD in SpeculativeConfig.__dataclass_fields__:
        passed = {"method": "custom_class", "model": spec.model, "num_speculative_tokens": 3,
                  SCHEDULE_FIELD: range_schedule(((8, 3),))}
        kept = getattr(_engine_config(model_dir, passed)[1].speculative_config, SCHEDULE_FIELD)
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "schedule": getattr(spec, SCHEDULE_FIELD, None), "passes_schedule": vllm_has_batch_size_schedule(),
            "schedule_kept_when_passed": _jsonable(kept),
            "proposer": getattr(spec, "model", None),
            "worker_extension_cls": config.parallel_config.worker_extension_cls,
            "additional_config_keys": sorted(config.additional_config),
            "enable_sleep_mode": config.model_config.enable_sleep_mode,
            "vocab_size": int(config.model_config.get_vocab_size()),
            "max_model_len": int(config.model_config.max_model_len),
            "enable_log_requests": engine_args.enable_log_requests,
            "disable_log_stats": engine_args.disable_log_stats}


def _fresh_drafter_stats() -> dict[str, Any]:
    """What a worker's fresh proposer answers ``samrollout_drafter_stats`` with (`ProposerStats.to_json`)."""
    from dataclasses import replace

    from samrollout.config import SpeculationConfig
    from samrollout.spec_decode.session import DraftSession, SessionSettings

    session = DraftSession(SpeculationConfig(), 64, SessionSettings(largest_draft=3, confident_k=3))
    return replace(session.stats(), no_draft_sampling_patched=True).to_json()


class StandInEngine:
    """What the server and the release's serving layer use of ``AsyncLLM``, with no engine behind it.

    Every method call is bound to the real ``AsyncLLM`` method's signature first: a method the
    release lacks, or arguments it does not take, are recorded in ``mismatches`` and raise.
    ``engine_core`` (the engine-core client) is checked the same way against ``AsyncMPClient``.
    """

    def __init__(self, vllm_config: Any, stat_loggers: list[Callable[..., Any]]) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.input_processor import InputProcessor

        self._real = AsyncLLM
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.errored = False
        self.dead_error = RuntimeError("the stand-in engine is dead")
        self.stat_loggers = [factory(vllm_config, 0) for factory in stat_loggers]
        self.calls: list[dict[str, Any]] = []
        self.mismatches: list[str] = []
        self.generated: list[dict[str, Any]] = []
        self.paused = self.sleeping = False
        self.engine_core = StandInEngineCore(self)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        _bind(self, self._real, "AsyncLLM", name, args, kwargs)

    # What the methods that only record their call return (given the engine); None for the rest.
    ANSWERS: ClassVar[dict[str, Callable[[StandInEngine], Any]]] = {
        "get_supported_tasks": lambda engine: ("generate",), "is_tracing_enabled": lambda engine: False,
        "is_paused": lambda engine: engine.paused, "is_sleeping": lambda engine: engine.sleeping,
        "reset_prefix_cache": lambda engine: True}
    # The state the methods that change it leave behind.
    EFFECTS: ClassVar[dict[str, tuple[str, bool]]] = {
        "pause_generation": ("paused", True), "resume_generation": ("paused", False),
        "sleep": ("sleeping", True), "wake_up": ("sleeping", False)}

    def __getattr__(self, name: str) -> Any:
        """Any other AsyncLLM method: checked and recorded, answered from ANSWERS and EFFECTS."""
        real = getattr(self._real, name, None) if not name.startswith("_") else None
        if not inspect.isfunction(real):
            raise AttributeError(name)

        def answer(*args: Any, **kwargs: Any) -> Any:
            self._call(name, *args, **kwargs)
            if name in self.EFFECTS:
                setattr(self, *self.EFFECTS[name])
            return self.ANSWERS[name](self) if name in self.ANSWERS else None

        if not inspect.iscoroutinefunction(real):
            return answer

        async def answer_async(*args: Any, **kwargs: Any) -> Any:
            return answer(*args, **kwargs)

        return answer_async

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self._call("collective_rpc", method, *args, **kwargs)
        self.calls[-1]["rpc"] = method
        return [_fresh_drafter_stats()] if method == "samrollout_drafter_stats" else [None]

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                       **kwargs: Any) -> AsyncIterator[Any]:
        from vllm.exceptions import VLLMNotFoundError, VLLMValidationError
        from vllm.outputs import CompletionOutput, RequestOutput

        generation_error = _generation_error()

        self._call("generate", prompt, sampling_params, request_id, *args, **kwargs)
        text = prompt.get("prompt") or ""
        self.generated.append({"request_id": request_id, "n": sampling_params.n, "prompt": text,
                               "extra_args": dict(sampling_params.extra_args or {}),
                               "max_tokens": sampling_params.max_tokens})
        if "RAISE-VALIDATION" in text:
            raise VLLMValidationError("the stand-in engine rejects this prompt", parameter="prompt")
        if "RAISE-NOT-FOUND" in text:
            raise VLLMNotFoundError("the stand-in engine has no such thing")
        if "RAISE-GENERATION" in text:
            raise generation_error("the stand-in engine failed")
        outputs = [CompletionOutput(index=i, text=" a b c", token_ids=list(TOKENS), cumulative_logprob=None,
                                    logprobs=None, finish_reason="length") for i in range(sampling_params.n)]
        yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt["prompt_token_ids"]),
                            prompt_logprobs=None, outputs=outputs, finished=True, num_cached_tokens=0)


def _bind(engine: StandInEngine, real_class: type, label: str, name: str, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> None:
    """Check a call of ``label.name`` against the release's ``real_class`` and record it in ``engine.calls``."""
    real = getattr(real_class, name, None)
    if real is None:
        engine.mismatches.append(f"{label}.{name} does not exist in vLLM {_version()}")
        raise AttributeError(name)
    try:
        inspect.signature(real).bind(engine, *args, **kwargs)
    except TypeError as error:
        engine.mismatches.append(f"{label}.{name}{inspect.signature(real)} rejects {args} {kwargs}: {error}")
        raise
    method = name if label == "AsyncLLM" else f"{label}.{name}"
    engine.calls.append({"method": method, "kwargs": _jsonable(kwargs)})


class StandInEngineCore:
    """``AsyncLLM.engine_core``, the engine-core client, with no engine behind it: each call is checked
    against the release's ``AsyncMPClient`` and recorded (as ``engine_core.<method>``) in the engine's calls."""

    EFFECTS: ClassVar[dict[str, bool]] = {"pause_scheduler_async": True, "pause_generation_async": True,
                                          "resume_scheduler_async": False}

    def __init__(self, engine: StandInEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        from vllm.v1.engine.core_client import AsyncMPClient

        real = getattr(AsyncMPClient, name, None) if not name.startswith("_") else None
        if not inspect.iscoroutinefunction(real):
            raise AttributeError(name)

        async def answer(*args: Any, **kwargs: Any) -> Any:
            _bind(self._engine, AsyncMPClient, "engine_core", name, args, kwargs)
            if name in self.EFFECTS:
                self._engine.paused = self.EFFECTS[name]
            return self._engine.paused if name == "is_scheduler_paused_async" else None

        return answer


def check_server(model_dir: str) -> dict[str, Any]:
    """The whole server (build_app, lifespan, routes) on the release's serving layer and a stand-in engine."""
    from fastapi.testclient import TestClient
    from vllm.v1.engine.async_llm import AsyncLLM

    from samrollout.server.app import build_app
    from samrollout.server.request_state.inflight import InflightRequest
    from samrollout.server.settings import ServerSettings

    engines: list[StandInEngine] = []
    real_from_vllm_config = AsyncLLM.from_vllm_config

    def from_vllm_config(cls: type, *args: Any, **kwargs: Any) -> StandInEngine:
        inspect.signature(real_from_vllm_config).bind(*args, **kwargs)  # what the server passes, the release takes
        engines.append(StandInEngine(kwargs["vllm_config"], kwargs.get("stat_loggers") or []))
        return engines[-1]

    AsyncLLM.from_vllm_config = classmethod(from_vllm_config)
    # fcfs: the release's serving layer names the engine requests (length-aware scheduling fans n > 1
    # out into child ids of its own, which ScheduledEngineClient.abort maps; tests/test_rollout_scheduling.py).
    settings = ServerSettings(model=model_dir, served_model_name="tiny", api_key=API_KEY, max_model_len=512,
                              max_n=4, dtype="float32", threshold_mode="static", rollout_scheduling="fcfs")
    weights = Path(tempfile.mkdtemp(prefix="probe-weights-"))  # the stand-in engine loads nothing from it
    for file in Path(model_dir).glob("*.safetensors"):  # but the server checks it against the served layout
        shutil.copyfile(file, weights / file.name)
    replies: dict[str, Any] = {}

    def keep(name: str, response: Any) -> None:
        body: Any
        try:
            body = response.json()
        except ValueError:
            body = response.text
        replies[name] = {"status": response.status_code, "body": body}

    completion = {"model": "tiny", "prompt": "hello world", "max_tokens": 3}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    app = build_app(settings)
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a Host the request gate admits
        keep("health", client.get("/health"))
        keep("models", client.get("/v1/models", headers=AUTH))
        keep("no_key", client.post("/v1/completions", json=completion))
        keep("completion", client.post("/v1/completions", headers={**AUTH, "X-Request-Id": "one"},
                                       json={**completion, "n": 2, "rollout_id": "r1", "group_id": "g1"}))
        keep("batch", client.post("/v1/completions", headers={**AUTH, "X-Request-Id": "two"},
                                  json={**completion, "prompt": ["first", "second"]}))
        keep("token_prompt", client.post("/v1/completions", headers=AUTH, json={**completion, "prompt": [1, 2, 3]}))
        keep("echo", client.post("/v1/completions", headers=AUTH, json={**completion, "echo": True}))
        stream = client.post("/v1/completions", headers=AUTH, json={**completion, "stream": True, "rollout_id": "r2"})
        replies["stream"] = {"status": stream.status_code, "events": [
            e[len("data: "):] for e in stream.text.split("\n\n") if e.startswith("data: ")]}
        keep("chat", client.post("/v1/chat/completions", headers={**AUTH, "X-Request-Id": "three"},
                                 json={**chat, "group_id": "g2"}))
        keep("n_too_big", client.post("/v1/completions", headers=AUTH, json={**completion, "n": 5}))
        keep("unknown_model", client.post("/v1/completions", headers=AUTH, json={**completion, "model": "other"}))
        keep("bad_type", client.post("/v1/completions", headers=AUTH, json={**completion, "max_tokens": "x"}))
        keep("too_long", client.post("/v1/completions", headers=AUTH, json={**completion, "max_tokens": 4096}))
        for kind in ("VALIDATION", "NOT-FOUND", "GENERATION"):
            keep(f"raise_{kind.lower()}", client.post("/v1/completions", headers=AUTH,
                                                      json={**completion, "prompt": f"RAISE-{kind}"}))
        keep("pause", client.post("/admin/pause", headers=AUTH, json={"mode": "keep"}))
        keep("status_paused", client.get("/admin/status", headers=AUTH))
        keep("resume", client.post("/admin/resume", headers=AUTH))
        keep("sleep_off", client.post("/admin/sleep", headers=AUTH, json={"level": 1}))
        # Sleep mode needs an accelerator (vLLM refuses it on CPU): switched on here after start.
        app.state.runtime.state.vllm_config.model_config.enable_sleep_mode = True
        keep("sleep", client.post("/admin/sleep", headers=AUTH, json={"level": 2}))
        keep("status_sleeping", client.get("/admin/status", headers=AUTH))
        keep("wake", client.post("/admin/wake", headers=AUTH))
        keep("reset_prefix_cache", client.post("/admin/reset_prefix_cache", headers=AUTH))
        keep("abort_rollout", client.post("/admin/abort_rollout", headers=AUTH, json={"rollout_id": "r1"}))
        keep("update_weights", client.post("/admin/update_weights", headers=AUTH,
                                           json={"path": str(weights), "version": "v2", "in_flight": "abort"}))
        keep("after_update", client.post("/v1/completions", headers=AUTH, json=completion))
        keep("update_continue", client.post("/admin/update_weights", headers=AUTH,
                                            json={"path": str(weights), "version": "v3", "in_flight": "continue"}))
        keep("status", client.get("/admin/status", headers=AUTH))
        metrics = client.get("/metrics")
        names = {line.split("{")[0].split(" ")[0] for line in metrics.text.splitlines()}
        replies["metrics"] = {"status": metrics.status_code,
                              "samrollout": sorted(n for n in names if n.startswith("samrollout_"))}
    shutil.rmtree(weights)
    (engine,) = engines
    return {"replies": replies, "engine_calls": engine.calls, "mismatches": engine.mismatches,
            "generated": engine.generated, "stat_loggers": [type(s).__name__ for s in engine.stat_loggers],
            "expected_engine_ids": {
                "completion": InflightRequest("one", "completion", 1, "r1").engine_ids(),
                "batch": InflightRequest("two", "completion", 2, None).engine_ids(),
                "chat": InflightRequest("three", "chat", 1, None).engine_ids()}}


def check_stat_logger(model_dir: str) -> dict[str, Any]:
    """SamStatLogger is the release's StatLoggerBase and reads its real per-step statistics."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from samrollout.metrics.engine_stats import SamStatLogger

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = {"drafts": value("samrollout_spec_decode_drafts_total"),
              "accepted_pos0": value("samrollout_spec_decode_accepted_tokens_per_position_total", position="0"),
              "finished": value("samrollout_requests_finished_total", finish_reason="length")}
    logger = SamStatLogger(None, 0)
    spec = SpecDecodingStats.new(num_spec_tokens=3)
    spec.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    iteration = IterationStats()
    iteration.num_generation_tokens = 5
    iteration.time_to_first_tokens_iter.append(0.25)
    iteration.finished_requests.append(FinishedRequestStats(
        finish_reason="length", e2e_latency=1.5, num_prompt_tokens=4, num_generation_tokens=6,
        mean_time_per_output_token=0.1))
    logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, spec_decoding_stats=spec), iteration,
                  None, 0)
    logger.log_engine_initialized()
    return {"is_stat_logger": isinstance(logger, StatLoggerBase),
            "abstract_left": sorted(getattr(SamStatLogger, "__abstractmethods__", ())),
            "drafts": value("samrollout_spec_decode_drafts_total") - before["drafts"],
            "accepted_pos0": value("samrollout_spec_decode_accepted_tokens_per_position_total", position="0")
            - before["accepted_pos0"],
            "finished": value("samrollout_requests_finished_total", finish_reason="length") - before["finished"],
            "running": value("samrollout_requests_running"), "waiting": value("samrollout_requests_waiting")}


def check_worker_reload(model_dir: str) -> dict[str, Any]:
    """SamWorkerExtension.samrollout_reload_weights on a worker with and without ``reload_weights``."""
    from samrollout.spec_decode.worker_extension import SamWorkerExtension

    seen: list[Any] = []

    class Runner:
        def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None,
                           is_checkpoint_format: bool = True) -> None:
            from vllm.config import get_current_vllm_config_or_none

            seen.append(("runner", weights_path, get_current_vllm_config_or_none() is worker.vllm_config))

    class NpuLikeWorker(SamWorkerExtension):  # vllm-ascend 0.23's NPUWorker: no reload_weights
        def __init__(self) -> None:
            from vllm.config import VllmConfig

            self.vllm_config = VllmConfig()
            self.model_runner = Runner()

    class VllmLikeWorker(SamWorkerExtension):
        def reload_weights(self, *args: Any, **kwargs: Any) -> None:
            seen.append(("worker", kwargs.get("weights_path"), None))

    worker = NpuLikeWorker()
    worker.samrollout_reload_weights("/weights/npu")
    VllmLikeWorker().samrollout_reload_weights("/weights/gpu")
    return {"seen": seen}


def check_error_mapping(model_dir: str) -> dict[str, Any]:
    """The release's create_error_response on what it raises; ERROR_TYPES covers every class it maps."""
    import vllm.exceptions
    from vllm.exceptions import VLLMNotFoundError, VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    from samrollout.server.vllm_compat.vllm_serving import ERROR_TYPES, create_error_response

    errors = [VLLMValidationError("bad n", parameter="n"), VLLMNotFoundError("no adapter"),
              _generation_error()("failed"), ValueError("v"), TypeError("t"), OverflowError("o")]
    if issubclass(EngineDeadError, getattr(vllm.exceptions, "VLLMError", ())):  # 0.23: a bare Exception (a 500)
        errors.append(EngineDeadError())
    retryable = getattr(vllm.exceptions, "RetryableRequestError", None)  # 0.33: a paused engine's refusal
    if retryable is not None:
        errors.append(retryable("paused"))
    mapped = {}
    for error in errors:
        response = create_error_response(error)
        mapped[type(error).__name__] = {"code": response.error.code, "param": response.error.param,
                                        "message": response.error.message,
                                        "handled": isinstance(error, ERROR_TYPES)}
    return {"mapped": mapped}


def check_no_draft_sampling(model_dir: str) -> dict[str, Any]:
    """The rejection-sampler patch (a vLLM general plugin) on the release's sampler module, and a draftless step."""
    import torch
    from vllm.v1.sample import rejection_sampler

    from samrollout.spec_decode.no_draft_sampling import patch

    patched = patch(rejection_sampler)
    bonus = torch.tensor([[5], [7]], dtype=torch.int64)
    # A step without drafts: answered by the patch (vLLM's kernels are never reached with these Nones).
    out = rejection_sampler.rejection_sample(torch.empty(0, dtype=torch.int32), [0, 0], 0, None, None, None, bonus,
                                             None)
    return {"patched": patched, "again": patch(rejection_sampler), "draftless_step": out.tolist(),
            "dtype": str(out.dtype),
            "marks": [bool(getattr(getattr(rejection_sampler, name), "__samrollout_patched__", False))
                      for name in ("rejection_sample", "apply_sampling_constraints")]}


def check_pause(model_dir: str) -> dict[str, Any]:
    """The layout's `pause_engine` in each mode: the calls it makes on the engine and its engine-core client."""
    import asyncio

    from samrollout.server.vllm_compat.vllm_serving import pause_engine

    engine = StandInEngine(_engine_config(model_dir)[1], [])
    paused = {}

    async def pause_each_mode() -> None:
        for mode in ("keep", "wait", "abort"):
            await pause_engine(engine, mode=mode, clear_cache=mode != "keep")
            paused[mode] = await engine.is_paused()
            await engine.resume_generation()

    asyncio.run(pause_each_mode())
    return {"calls": engine.calls, "mismatches": engine.mismatches, "paused": paused}


CHECKS = {f.__name__.removeprefix("check_"): f for f in (
    check_layout, check_flags, check_engine_config, check_server, check_stat_logger, check_worker_reload,
    check_error_mapping, check_no_draft_sampling, check_pause)}


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    results: dict[str, Any] = {}
    for name, check in CHECKS.items():
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, **check(model_dir)}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        out.write_text(json.dumps(results, indent=1, default=repr))


if __name__ == "__main__":
    main()
