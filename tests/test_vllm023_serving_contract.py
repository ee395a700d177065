"""`samrollout serve` against vLLM 0.23.0 (the vLLM vllm-ascend 0.23 runs on), which cannot run here.

vLLM 0.23's compiled ops need torch 2.11, so its released Python source (vllm-0.23.0.tar.gz
from PyPI, sha256 pinned, cached by tests/support/pypi_source.py: the exact source Ascend installs
build, and byte-identical in these files to the vllm 0.23.0 wheel) is checked two ways
(helpers shared with the vLLM 0.33 test in tests/support/vllm_contract.py):

- read with ``ast``: every name the server's 0.23 layout imports exists with the signature the
  server calls it with; every engine method the server calls exists in 0.23's ``AsyncLLM`` and
  takes the arguments it is given; the app-state attributes the routes read are set by 0.23's
  ``init_app_state``; the stat logger interface, the worker extension and the weight-reload path
  (with vllm-ascend's worker) fit;
- run (tests/support/vllm_probe.py, in a subprocess with 0.23's source ahead of the installed vLLM):
  the server picks its 0.23 layout, vLLM 0.23 parses and validates the settings' flags and builds
  the engine config, and the whole app serves completions, chat, streaming, errors and the admin
  API through vLLM 0.23's serving layer to a stand-in engine that checks each call against 0.23's
  ``AsyncLLM``.

The version switch itself (which layout each vLLM gets, all of them alike) is tested here too.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from samrollout.cli import main as cli_main
from samrollout.server.engine.vllm_argv import vllm_argv
from samrollout.server.settings import ServerSettings
from samrollout.server.vllm_compat import vllm_serving
from samrollout.server.vllm_compat.vllm_version import SUPPORTED_SERIES, UnsupportedVllmError, serving_series
from samrollout.spec_decode.worker_extension import SamWorkerExtension
from support.ascend_source import ascend_source
from support.vllm_contract import (
    DEFAULT_LARGEST_DRAFT,
    LAYOUTS,
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

LAYOUT = "v0_23.py"


@pytest.fixture(scope="session")
def v023() -> Path:
    """vLLM 0.23.0's project root (``vllm/`` under it); downloaded once, no network is a failure."""
    return release_source("0.23.0")


@pytest.fixture(scope="session")
def probe(contract_probes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """tests/support/vllm_probe.py's results on vLLM 0.23's source (run beside the other releases', once)."""
    return contract_probes["0.23.0"]


# --- the version switch (no vLLM 0.23 needed) ---

def test_series_of_vllm_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serving_series("0.32.0") == "0.32"
    assert serving_series("0.32.3+cu129") == "0.32"
    assert serving_series("0.33.0") == "0.33"
    assert serving_series("0.33.2+cu130") == "0.33"
    assert serving_series("0.23.0") == "0.23"
    assert serving_series("0.23.0+empty") == "0.23"  # built from source for Ascend (docs/ascend.md)
    assert serving_series("0.23.1.dev4+g91df0fad4") == "0.23"
    for unsupported in ("0.24.0", "0.31.0", "0.34.0", "0.3.2", "1.0.0", "0.232.0", "0.330.0", "dev"):
        with pytest.raises(UnsupportedVllmError, match=r"vLLM 0\.32\.x, vLLM 0\.33\.x, vLLM 0\.23\.x"):
            serving_series(unsupported)
    monkeypatch.setenv("VLLM_VERSION", "0.23.0")
    assert serving_series() == "0.23"
    monkeypatch.setenv("VLLM_VERSION", "0.33.1.dev2+g4ba787ec9")
    assert serving_series() == "0.33"
    monkeypatch.delenv("VLLM_VERSION")
    import vllm

    assert serving_series() == serving_series(vllm.__version__)


def test_serve_refuses_an_unsupported_vllm(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_VERSION", "0.24.0")
    assert cli_main(["serve"]) == 2
    message = capsys.readouterr().err
    assert "0.24.0" in message and all(supported in message for supported in SUPPORTED_SERIES.values())


def test_installed_vllm_uses_the_0_32_layout() -> None:
    assert serving_series() == "0.32"
    assert vllm_serving.init_app_state.__module__ == "vllm.entrypoints.launchers.api_server.app_state"
    assert vllm_serving.make_arg_parser.__module__ == "vllm.entrypoints.launchers.cli_args"
    assert vllm_serving.PER_REQUEST_METRICS


def test_every_supported_series_has_a_layout_and_they_export_the_same_names() -> None:
    layouts = sorted(path.name for path in LAYOUTS.glob("v*.py"))
    assert layouts == sorted(f"v{series.replace('.', '_')}.py" for series in SUPPORTED_SERIES)
    names = all_names(LAYOUTS / "v0_32.py")
    for layout in layouts:
        assert all_names(LAYOUTS / layout) == names, layout
        missing = set(names) - top_level_names(tree(LAYOUTS / layout))
        assert not missing, f"{layout} lists {missing} in __all__ but does not define them"
    assert set(names) <= set(dir(vllm_serving))


def test_settings_pass_per_request_metrics_flags_only_when_vllm_has_them() -> None:
    settings = ServerSettings(model="m")
    with_flags = vllm_argv(settings, "m", "cpu")
    assert "--enable-per-request-metrics" in with_flags and "--per-request-spec-decode-metrics" in with_flags
    without = vllm_argv(settings, "m", "cpu", per_request_metrics_flags=False)
    assert not any(flag.startswith("--enable-per-request") or flag.startswith("--per-request") for flag in without)


# --- vLLM 0.23's source, read ---

def test_source_is_vllm_0_23_0(v023: Path) -> None:
    assert "\nVersion: 0.23.0\n" in (v023 / "PKG-INFO").read_text()
    assert "__version__ = version = '0.23.0'" in (v023 / "vllm" / "_version.py").read_text()


def test_every_name_the_0_23_layout_imports_exists_in_vllm_0_23(v023: Path) -> None:
    assert missing_layout_imports(v023, LAYOUT) == []


# The functions the layouts export, with the parameters the server (and vLLM's own callers) rely on.
SIGNATURES = {
    "init_app_state": ("vllm.entrypoints.openai.api_server", ["engine_client", "state", "args", "supported_tasks"]),
    "make_arg_parser": ("vllm.entrypoints.openai.cli_args", ["parser"]),
    "validate_parsed_serve_args": ("vllm.entrypoints.openai.cli_args", ["args"]),
    "create_error_response": ("vllm.entrypoints.serve.utils.error_response",
                              ["message", "err_type", "status_code", "param"]),
    "with_cancellation": ("vllm.entrypoints.serve.utils.api_utils", ["handler_func"]),
    "validate_json_request": ("vllm.entrypoints.serve.utils.api_utils", ["raw_request"]),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_serving_functions_keep_their_signatures(v023: Path, name: str) -> None:
    module, expected = SIGNATURES[name]
    assert params(function_def(tree(module_path(v023, module)), name)) == expected, f"vLLM 0.23's {name}"
    assert list(inspect.signature(getattr(vllm_serving, name)).parameters) == expected, f"vLLM 0.32's {name}"


def test_request_models_have_the_fields_rl_fields_uses(v023: Path) -> None:
    used = {"n", "echo", "vllm_xargs", "return_token_ids", "request_id"}
    for module, name, own in (("vllm.entrypoints.openai.completion.protocol", "CompletionRequest", {"prompt"}),
                              ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest",
                               {"messages"})):
        fields = dataclass_fields(class_def(v023, module, name))
        assert used | own <= fields, f"vLLM 0.23's {name} lacks {(used | own) - fields}"
        assert used | own <= set(getattr(vllm_serving, name).model_fields), f"vLLM 0.32's {name}"
        assert not {"rollout_id", "group_id"} & fields  # ours, added by subclassing


def test_flexible_argument_parser_is_an_argument_parser(v023: Path) -> None:
    cls = class_def(v023, "vllm.utils.argparse_utils", "FlexibleArgumentParser")
    assert [ast.unparse(b) for b in cls.bases] == ["ArgumentParser"]


def test_engine_methods_the_server_calls_exist_in_vllm_0_23(v023: Path) -> None:
    called = check_engine_calls(v023, LAYOUT, "0.23")
    # Not is_sleeping nor is_paused: /admin/status reports what /admin/pause and /admin/sleep did.
    assert {"from_vllm_config", "pause_generation", "resume_generation", "sleep", "wake_up", "collective_rpc",
            "reset_prefix_cache", "abort", "check_health", "shutdown",
            "get_supported_tasks"} <= called
    pause_mode = next(n for n in tree(module_path(v023, "vllm.v1.engine")).body
                      if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PauseMode")
    pause_modes = ast.literal_eval(ast.unparse(pause_mode.value).removeprefix("Literal"))
    assert {"keep", "wait", "abort"} <= set(pause_modes)  # /admin/pause modes and update_weights' in_flight


def test_engine_weight_version_is_left_to_the_later_layouts(v023: Path) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = class_def(v023, "vllm.v1.engine.async_llm", "AsyncLLM")
    assert "update_weight_version" not in methods(engine)
    assert hasattr(AsyncLLM, "update_weight_version")
    assert "update_weight_version" not in {method for method, *_ in engine_calls(LAYOUT)}


def test_app_state_attributes_the_routes_read_are_set_by_vllm_0_23(v023: Path) -> None:
    read = state_attributes_read(LAYOUT)
    assert {"openai_serving_completion", "openai_serving_chat", "openai_serving_models", "vllm_config"} <= read
    assigned = state_attributes_set(v023, [("vllm.entrypoints.openai.api_server", "init_app_state"),
                                           ("vllm.entrypoints.generate.api_router", "init_generate_state")])
    assert read <= assigned, f"vLLM 0.23's init_app_state does not set {read - assigned}"
    # init_app_state hands its state to init_generate_state (which builds completion and chat).
    calls = [n for n in ast.walk(function_def(tree(module_path(v023, "vllm.entrypoints.openai.api_server")),
                                              "init_app_state"))
             if isinstance(n, ast.Call) and ast.unparse(n.func) == "init_generate_state"]
    assert calls and ast.unparse(calls[0].args[1]) == "state"


def test_serving_objects_have_the_methods_the_routes_call(v023: Path) -> None:
    assert_serving_methods(v023, "0.23")


def test_stat_logger_fits_vllm_0_23s_interface(v023: Path) -> None:
    assert_stat_logger_interface(v023, "0.23")
    # 0.23 counts no drafted tokens per position (engine_stats falls back); 0.32 does.
    fields = dataclass_fields(class_def(v023, "vllm.v1.spec_decode.metrics", "SpecDecodingStats"))
    assert "num_accepted_tokens_per_pos" in fields and "num_draft_tokens_per_pos" not in fields
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    assert "num_draft_tokens_per_pos" in SpecDecodingStats.__dataclass_fields__


def test_vllm_0_23_has_no_per_request_metrics_flags(v023: Path) -> None:
    for path in [module_path(v023, "vllm.engine.arg_utils"), module_path(v023, "vllm.entrypoints.openai.cli_args"),
                 *(v023 / "vllm" / "config").glob("*.py")]:
        text = path.read_text()
        assert "per_request_metrics" not in text and "per_request_spec_decode_metrics" not in text, path


def test_worker_extension_fits_vllm_0_23_and_vllm_ascend_workers(v023: Path) -> None:
    ascend = ascend_source("0.23.0.post1")
    ours = {name for name in dir(SamWorkerExtension) if not name.startswith("__")}
    workers = [class_def(v023, "vllm.v1.worker.worker_base", "WorkerBase"),
               class_def(v023, "vllm.v1.worker.gpu_worker", "Worker"),
               class_def(ascend, "vllm_ascend.worker.worker", "NPUWorker")]
    for worker in workers:  # vLLM asserts the worker has none of the extension's attributes
        assert not ours & class_attributes(worker), f"{worker.name} already has {ours & class_attributes(worker)}"
    source = module_path(v023, "vllm.v1.worker.worker_base").read_text()
    assert "worker_class.__bases__ = worker_class.__bases__ + (" in source  # how the extension is mixed in
    # Weights: vLLM's worker has reload_weights; vllm-ascend's NPUWorker has not, and its runner inherits vLLM's.
    assert "reload_weights" in methods(workers[1])
    assert not {"reload_weights", "__getattr__"} & (class_attributes(workers[0]) | class_attributes(workers[2]))
    runner = class_def(ascend, "vllm_ascend.worker.model_runner_v1", "NPUModelRunner")
    assert [ast.unparse(b) for b in runner.bases] == ["GPUModelRunner"] and "reload_weights" not in methods(runner)
    reload = function_def(class_def(v023, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"), "reload_weights")
    assert "weights_path" in params(reload)
    assert "set_current_vllm_config" in top_level_names(tree(module_path(v023, "vllm.config")))
    # samrollout_drafter_stats reports whether the no-draft sampling patch reached this function.
    assert "rejection_sample" in top_level_names(tree(module_path(v023, "vllm.v1.sample.rejection_sampler")))


# --- vLLM 0.23's source, run (tests/support/vllm_probe.py) ---

def test_server_picks_its_0_23_layout(probe: dict[str, Any]) -> None:
    layout = probe_result(probe, "layout")
    assert layout["vllm_version"] == "0.23.0" and "/vllm/0.23.0/" in layout["vllm_file"]
    assert layout["series"] == "0.23"
    assert layout["init_app_state"] == "vllm.entrypoints.openai.api_server"
    assert layout["completion_request"] == "vllm.entrypoints.openai.completion.protocol"
    assert layout["per_request_metrics"] is False


def test_vllm_0_23_parses_and_validates_the_settings_flags(probe: dict[str, Any], tiny_dir: Path) -> None:
    flags = assert_flags(probe, tiny_dir)
    default = flags["default"]
    assert default["namespace"]["speculative_config"] == {
        "method": "custom_class", "num_speculative_tokens": DEFAULT_LARGEST_DRAFT,
        "model": "samrollout.spec_decode.proposer.SamProposer"}
    assert any("per-request metrics are off: vLLM 0.23.0" in line for line in default["log"])
    assert not any(flag.startswith("--enable-per-request") or flag.startswith("--per-request")
                   for flag in default["argv"])
    assert flags["per_request_flags_rejected"] == {"--enable-per-request-metrics": True,
                                                   "--per-request-spec-decode-metrics": True}


def test_vllm_0_23_builds_the_engine_config_with_sam(probe: dict[str, Any]) -> None:
    config = assert_engine_config(probe)
    # No batch-size schedule in 0.23: the proposer's gate applies the static threshold itself.
    assert config["schedule"] is None and config["passes_schedule"] is False
    assert config["schedule_kept_when_passed"] is None


def test_openai_routes_on_vllm_0_23(probe: dict[str, Any]) -> None:
    replies = assert_openai_routes(probe_server(probe))
    assert all(reply["body"].get("metrics") is None for reply in replies.values()  # no per-request metrics on 0.23
               if isinstance(reply.get("body"), dict))


def test_rl_ids_reach_vllm_0_23s_engine_and_request_ids_are_the_ones_aborts_use(probe: dict[str, Any]) -> None:
    assert_rl_ids_reach_the_engine(probe_server(probe))


def test_errors_on_vllm_0_23(probe: dict[str, Any]) -> None:
    mapped = assert_errors(probe)
    assert set(mapped) == {"VLLMValidationError", "VLLMNotFoundError", "GenerationError", "ValueError", "TypeError",
                           "OverflowError"}  # 0.23's EngineDeadError is a bare Exception: our 500 handler's


def test_admin_routes_on_vllm_0_23(probe: dict[str, Any]) -> None:
    server = probe_server(probe)
    assert_admin_routes(server)
    assert not any(c["method"] == "update_weight_version" for c in server["engine_calls"])


def test_pausing_on_vllm_0_23_is_asyncllms_own(probe: dict[str, Any]) -> None:
    pause = probe_result(probe, "pause")
    assert pause["mismatches"] == []
    assert [c for c in pause["calls"] if c["method"] == "pause_generation"] == [
        {"method": "pause_generation", "kwargs": {"mode": "keep", "clear_cache": False}},
        {"method": "pause_generation", "kwargs": {"mode": "wait", "clear_cache": True}},
        {"method": "pause_generation", "kwargs": {"mode": "abort", "clear_cache": True}}]
    assert not any(c["method"].startswith("engine_core.") for c in pause["calls"])


def test_stat_logger_reads_vllm_0_23s_statistics(probe: dict[str, Any]) -> None:
    assert_stat_logger(probe)


def test_weights_reload_on_workers_with_and_without_reload_weights(probe: dict[str, Any]) -> None:
    assert_worker_reload(probe)


def test_no_draft_sampling_patches_vllm_0_23s_rejection_sampler(probe: dict[str, Any]) -> None:
    assert_no_draft_sampling(probe)
