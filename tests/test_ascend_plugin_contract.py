"""The Ascend plugin (samrollout.vllm_plugins.ascend_plugin) against vllm-ascend 0.23's real source.

vllm-ascend cannot be imported without torch_npu and an NPU, so its released source
(tests/support/ascend_source.py: from PyPI, cached) is read with ``ast``: the functions the plugin
patches exist with the signatures it assumes, the draft path hands a custom_class proposer
what vLLM's GPU runner hands it, and the runner exposes what `SamProposer` reads.  The real
``get_spec_decode_method``, ``_get_drafter`` and ``propose_draft_token_ids`` are then compiled
into a small stand-in ``vllm_ascend`` package (everything else they name replaced by stand-ins)
and imported through the plugin's real import hook, so the patched functions run as shipped.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from samrollout.engine import PROPOSER_CLASS
from samrollout.spec_decode.proposer import SamProposer
from samrollout.spec_decode.stats import ProposerStats
from samrollout.spec_decode.worker_extension import SamWorkerExtension
from samrollout.vllm_plugins import ascend_plugin
from support.ascend_source import ARTIFACTS, AscendSourceUnavailable, ascend_source

VERSIONS = sorted(ascend_plugin.SUPPORTED)
ENTRY_POINT = ("samrollout_ascend", "samrollout.vllm_plugins.ascend_plugin:register")


@pytest.fixture(scope="session", params=VERSIONS)
def source(request: pytest.FixtureRequest) -> Path:
    """vllm-ascend's project root for each supported version (downloaded once; no network is a failure)."""
    try:
        return ascend_source(request.param)
    except AscendSourceUnavailable as error:
        reason = str(error)
    pytest.fail(f"vllm-ascend {request.param}'s source is needed (PyPI) and could not be had: {reason}", pytrace=False)


# --- reading the source ---

@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _files_mentioning(root: Path, *words: str) -> list[Path]:
    """vllm_ascend's files that contain one of ``words`` (parsing all ~450 takes seconds)."""
    return [p for p in (root / "vllm_ascend").rglob("*.py") if any(w in p.read_text() for w in words)]


def _module_path(root: Path, module: str) -> Path:
    path = root / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    assert found, f"class {name} is gone"
    return found[0]


def _function(body: ast.Module | ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [node for node in body.body if isinstance(node, ast.FunctionDef) and node.name == name]
    assert found, f"function {name} is gone"
    return found[0]


def _params(function: ast.FunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]


def _is_self_attr(node: ast.AST, *chain: str) -> bool:
    """``node`` is ``self.<chain[0]>.<chain[1]>...``."""
    for attr in reversed(chain):
        if not (isinstance(node, ast.Attribute) and node.attr == attr):
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _runner(root: Path) -> ast.ClassDef:
    return _class(_tree(_module_path(root, ascend_plugin.RUNNER_MODULE)), ascend_plugin.RUNNER_CLASS)


def _spec_decode_method(root: Path) -> ast.FunctionDef:
    return _function(_tree(_module_path(root, ascend_plugin.SPEC_DECODE_MODULE)), "get_spec_decode_method")


def _compared_strings(function: ast.FunctionDef, name: str) -> set[str]:
    """String constants ``name`` is compared with (``==`` or ``in (...)``)."""
    found: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == name:
            for right in node.comparators:
                found |= {c.value for c in ast.walk(right) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return found


# --- the plugin's targets and their signatures ---

def test_supported_versions_pair_with_the_vllm_each_vllm_ascend_release_documents(source: Path) -> None:
    version = source.name
    assert f"__version__ = version = {version!r}" in (source / "vllm_ascend" / "_version.py").read_text()
    matrix = (ascend_source("0.23.0.post1") / "docs/source/community/versioning_policy.md").read_text()
    documented = dict(re.findall(r"^\|\s*v(\S+)\s*\|\s*v(\S+)\s*\|", matrix, re.MULTILINE))
    assert documented[version] == ascend_plugin.SUPPORTED[version]
    assert set(ascend_plugin.SUPPORTED) == set(ARTIFACTS)


def test_ascend_plugin_patches_functions_that_exist_in_vllm_ascend_0_23(source: Path) -> None:
    _spec_decode_method(source)
    runner = _runner(source)
    assert [ast.unparse(base) for base in runner.bases] == ["GPUModelRunner"]
    _function(runner, "propose_draft_token_ids")
    # _get_drafter looks get_spec_decode_method up in the runner module's globals, which bound it at import:
    # the plugin must patch that name there (patching vllm_ascend.spec_decode alone would change nothing).
    (call,) = [n for n in ast.walk(_function(runner, "_get_drafter")) if isinstance(n, ast.Call)
               and isinstance(n.func, ast.Name) and n.func.id == "get_spec_decode_method"]
    assert [ast.unparse(a) for a in call.args] == ["self.speculative_config.method", "self.vllm_config",
                                                  "self.device", "self"]
    runner_tree = _tree(_module_path(source, ascend_plugin.RUNNER_MODULE))
    imports = [n for n in runner_tree.body
               if isinstance(n, ast.ImportFrom) and n.module == ascend_plugin.SPEC_DECODE_MODULE]
    assert any(alias.name == "get_spec_decode_method" and alias.asname is None for n in imports for alias in n.names)
    # vllm-ascend runs the V1 runner (this one) on vLLM 0.23.0, whatever VLLM_USE_V2_MODEL_RUNNER says.
    worker = _class(_tree(_module_path(source, "vllm_ascend.worker.worker")), "NPUWorker")
    assert any(ast.unparse(n.test) == "self.use_v2_model_runner and vllm_version_is('0.23.0')"
               and "self.use_v2_model_runner = False" in ast.unparse(n)
               for n in ast.walk(worker) if isinstance(n, ast.If))
    # No other runner (310P, xlite, ...) overrides what the plugin patches on NPUModelRunner.
    for path in _files_mentioning(source, "propose_draft_token_ids", "_get_drafter"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef) and node.name != ascend_plugin.RUNNER_CLASS:
                overridden = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert not overridden & {"propose_draft_token_ids", "_get_drafter"}, f"{path}: {node.name}"


def test_ascend_plugin_patched_signatures_unchanged(source: Path) -> None:
    assert _params(_spec_decode_method(source)) == ["method", "vllm_config", "device", "runner"]
    wrapper = ascend_plugin.wrap_get_spec_decode_method(lambda *a: None)
    assert _params(_spec_decode_method(source)) == list(inspect.signature(wrapper, follow_wrapped=False).parameters)
    propose = _function(_runner(source), "propose_draft_token_ids")
    assert _params(propose) == [
        "self", "valid_sampled_token_ids", "sampling_metadata", "scheduler_output", "spec_decode_metadata",
        "spec_decode_common_attn_metadata", "positions", "num_scheduled_tokens", "hidden_states",
        "aux_hidden_states", "sample_hidden_states", "target_model_batch_desc"]
    assert propose.args.vararg is None and propose.args.kwarg is None

    class Runner:
        def propose_draft_token_ids(self, valid_sampled_token_ids: Any, *args: Any) -> None: ...

    ascend_plugin.patch_model_runner(Runner)
    wrapped = inspect.signature(Runner.propose_draft_token_ids, follow_wrapped=False)
    assert list(wrapped.parameters)[:2] == _params(propose)[:2]  # keyword calls reach the wrapper too


def test_custom_class_is_unknown_to_vllm_ascend_0_23_without_the_plugin(source: Path) -> None:
    """The reason for the plugin; if vllm-ascend learns custom_class, the plugin should step aside."""
    method = _spec_decode_method(source)
    assert "custom_class" not in _compared_strings(method, "method")
    assert {"ngram", "suffix", "eagle", "mtp"} <= _compared_strings(method, "method")
    assert isinstance(method.body[-1], ast.If)
    assert "custom_class" not in ast.unparse(_function(_runner(source), "propose_draft_token_ids"))


def test_custom_class_drafts_from_cpu_tokens_after_bookkeeping(source: Path) -> None:
    """Like vLLM's GPU runner: propose() gets list[list[int]] and a token_ids_cpu that already holds them."""
    runner = _runner(source)
    sample = _function(runner, "sample_tokens")
    (local,) = [n for n in sample.body if isinstance(n, ast.FunctionDef) and n.name == "propose_draft_token_ids"]
    (call,) = [n for n in ast.walk(local)
               if isinstance(n, ast.Call) and _is_self_attr(n.func, "propose_draft_token_ids")]
    assert ast.unparse(call.args[0]) == _params(local)[0]  # the sampled tokens go first, positionally
    # Only these methods take the padded (NPU tensor) path; every other one, custom_class included, the CPU list.
    (padded,) = [n for n in ast.walk(sample) if isinstance(n, ast.Assign)
                 and [ast.unparse(t) for t in n.targets] == ["use_padded_batch"]]
    checks = {n.func.attr for n in ast.walk(padded.value)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert checks == {"use_eagle", "uses_draft_model", "uses_extract_hidden_states", "use_ngram_gpu"}
    cpu_calls = [n for n in ast.walk(sample) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and ast.unparse(n) == "propose_draft_token_ids(valid_sampled_token_ids)"]
    bookkeeping = [n for n in ast.walk(sample) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and _is_self_attr(n.value.func, "_bookkeeping_sync")
                   and "valid_sampled_token_ids" in ast.unparse(n.targets[0])]
    assert len(cpu_calls) == 1 and len(bookkeeping) == 1 and bookkeeping[0].lineno < cpu_calls[0].lineno
    # _bookkeeping_sync appends the sampled tokens to token_ids_cpu and moves num_tokens_no_spec.
    written = {ast.unparse(t.value) for n in ast.walk(_function(runner, "_bookkeeping_sync"))
               if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Subscript)}
    assert {"self.input_batch.token_ids_cpu", "self.input_batch.num_tokens_no_spec"} <= written


def _proposer_reads() -> tuple[set[str], set[str]]:
    """Attributes SamProposer reads on ``self.runner`` and on the input batch (``batch = self.runner.input_batch``)."""
    tree = ast.parse(Path(inspect.getfile(SamProposer)).read_text())
    on_runner = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_self_attr(n.value, "runner")}
    on_batch = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "batch"}
    return on_runner, on_batch


def test_npu_runner_exposes_what_sam_proposer_reads(source: Path) -> None:
    on_runner, on_batch = _proposer_reads()
    assert on_runner == {"input_batch", "requests"}, "SamProposer reads something new: check the NPU runner has it"
    runner = _runner(source)
    assigned = {ast.unparse(t) for n in ast.walk(runner) if isinstance(n, ast.Assign) for t in n.targets}
    assert "self.input_batch" in assigned
    used = {ast.unparse(n) for n in ast.walk(runner) if isinstance(n, ast.Attribute)}
    assert "self.requests" in used  # vLLM's GPUModelRunner.requests (dict of CachedRequestState), inherited
    batch = _class(_tree(_module_path(source, "vllm_ascend.worker.npu_input_batch")), "NPUInputBatch")
    assert [ast.unparse(b) for b in batch.bases] == ["InputBatch"]  # req_ids: vLLM's property over _req_ids
    init = _function(batch, "__init__")
    set_in_init = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                   if isinstance(t, ast.Attribute) and _is_self_attr(t, t.attr)}
    assert on_batch - {"req_ids"} <= set_in_init
    assert {"_req_ids", "token_ids_cpu", "num_tokens_no_spec"} <= set_in_init
    assert "req_ids" not in {f.name for f in batch.body if isinstance(f, ast.FunctionDef)}


# What the NPU runner reads or calls on self.drafter only for other methods (behind isinstance or method checks).
OTHER_METHODS_ONLY = {"_propose", "attn_layer_names", "eagle3_use_aux_hidden_state", "initialize_attn_backend",
                      "initialize_cudagraph_keys", "k", "max_n", "min_n", "prepare_inputs", "prepare_inputs_padded",
                      "prepare_next_token_ids_cpu", "prepare_next_token_ids_padded", "set_per_group_attn_metadata",
                      "model"}  # model: behind hasattr()


def test_npu_runner_calls_on_the_drafter_are_all_provided(source: Path) -> None:
    used = {n.attr for path in _files_mentioning(source, "drafter") for n in ast.walk(_tree(path))
            if isinstance(n, ast.Attribute) and _is_self_attr(n.value, "drafter")}
    assert used - OTHER_METHODS_ONLY == {"propose", "load_model", "dummy_run"}, "a new call on every drafter?"
    calls = {n.func.attr: n for n in ast.walk(_runner(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and _is_self_attr(n.func.value, "drafter")}
    drafter = object.__new__(ascend_plugin.npu_proposer_class(SamProposer))
    drafter.dummy_run(*[None] * len(calls["dummy_run"].args), **{k.arg: None for k in calls["dummy_run"].keywords})
    drafter.load_model(*[None] * len(calls["load_model"].args))


# --- the plugin off Ascend, and its entry point ---

@contextmanager
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The plugin's log records in ``caplog`` (vLLM's logger, its parent, does not propagate to the root)."""
    logger = ascend_plugin.logger
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)


def test_entry_point_is_registered() -> None:
    plugins = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    name, value = ENTRY_POINT
    assert name in plugins, "add the entry point to pyproject.toml and reinstall (pip install -e .)"
    assert plugins[name].value == value
    assert plugins[name].load() is ascend_plugin.register


def test_plugin_is_noop_without_vllm_ascend(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("vllm-ascend is installed here")
    import vllm.plugins  # noqa: F401  (vLLM imported, as when it loads its plugins)

    monkeypatch.setattr(ascend_plugin, "_registered", False)
    modules = set(sys.modules)
    meta_path = list(sys.meta_path)
    vllm_state = {name: {k: id(v) for k, v in vars(module).items()} for name, module in sys.modules.items()
                  if name == "vllm" or name.startswith("vllm.")}
    with plugin_log(caplog):
        ascend_plugin.register()
        ascend_plugin.register()
    assert "vllm-ascend is not installed" in caplog.text
    assert set(sys.modules) == modules and sys.meta_path == meta_path
    assert vllm_state == {name: {k: id(v) for k, v in vars(sys.modules[name]).items()} for name in vllm_state}


def test_plugin_stays_off_for_other_versions() -> None:
    reason = ascend_plugin.unsupported_reason
    assert reason(None, None) == "vllm-ascend is not installed"
    assert reason("0.23.0", "0.23.0") is None
    assert reason("0.23.0.post1", "0.23.0+empty") is None  # vLLM built from source for Ascend
    assert "not a supported version" in str(reason("0.22.0", "0.22.0"))
    assert "not a supported version" in str(reason("0.23.0rc1", "0.23.0"))
    assert "needs vLLM 0.23.0" in str(reason("0.23.0", "0.32.0"))
    assert "needs vLLM 0.23.0" in str(reason("0.23.0", None))


def test_plugin_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> tuple[str, str]:
        raise RuntimeError("broken metadata")

    monkeypatch.setattr(ascend_plugin, "_registered", False)
    monkeypatch.setattr(ascend_plugin, "installed_versions", broken)
    with plugin_log(caplog):
        ascend_plugin.register()
    assert "failed to register" in caplog.text


# --- the real functions, patched ---

# Stand-ins for everything the real functions name besides themselves: proposer classes that record their
# arguments, vllm_version_is for vLLM 0.23.0, and for the rest (torch, ...) an object that fails when used.
STAND_INS = '''
from __future__ import annotations


class StandInProposer:
    def __init__(self, *args):
        self.args = args
        self.calls = []

    def propose(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return [[-1]]


class Absent:
    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        raise AssertionError(f"the custom_class path used {self.name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"the custom_class path called {self.name}")


def vllm_version_is(version):
    return version == "0.23.0"
'''


def _free_names(function: ast.FunctionDef) -> set[str]:
    loaded = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stored = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    params = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    return loaded - stored - params - set(dir(builtins))


def _stand_ins(names: set[str], proposers: str) -> str:
    lines = []
    for name in sorted(names):
        if name.startswith("Ascend") and "Proposer" in name:
            lines.append(f"from {proposers} import {name}" if proposers else f"class {name}(StandInProposer): pass")
        elif name != "vllm_version_is":
            lines.append(f"{name} = Absent({name!r})")
    return "\n".join(lines)


def _write_stand_in_package(root: Path, into: Path) -> None:
    """vllm_ascend with the real get_spec_decode_method, _get_drafter and propose_draft_token_ids."""
    spec_method = _spec_decode_method(root)
    runner = _runner(root)
    methods = [_function(runner, "_get_drafter"), _function(runner, "propose_draft_token_ids")]
    proposers = {n for n in _free_names(spec_method) | set().union(*map(_free_names, methods))
                 if n.startswith("Ascend") and "Proposer" in n}
    package = into / "vllm_ascend"
    (package / "spec_decode").mkdir(parents=True)
    (package / "worker").mkdir()
    (package / "__init__.py").write_text("")
    (package / "worker" / "__init__.py").write_text("")
    (package / "spec_decode" / "__init__.py").write_text("\n\n".join([
        STAND_INS, _stand_ins(proposers | (_free_names(spec_method) - proposers), ""), ast.unparse(spec_method)]))
    runner_imports = [n for n in _tree(_module_path(root, ascend_plugin.RUNNER_MODULE)).body
                      if isinstance(n, ast.ImportFrom) and n.module == ascend_plugin.SPEC_DECODE_MODULE]
    body = textwrap.indent("\n\n".join(ast.unparse(m) for m in methods), "    ")
    (package / "worker" / "model_runner_v1.py").write_text("\n\n".join([
        STAND_INS, "\n".join(ast.unparse(n) for n in runner_imports),
        _stand_ins(set().union(*map(_free_names, methods)) - {"get_spec_decode_method"}, "vllm_ascend.spec_decode"),
        f"class {ascend_plugin.RUNNER_CLASS}:\n{body}\n"]))


def _purge_vllm_ascend() -> None:
    for name in [m for m in sys.modules if m == "vllm_ascend" or m.startswith("vllm_ascend.")]:
        del sys.modules[name]


@pytest.fixture
def stand_in_vllm_ascend(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stand-in package on sys.path, with the plugin unregistered and sys.meta_path restored afterwards."""
    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("a real vllm-ascend is installed here")
    _write_stand_in_package(source, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(ascend_plugin, "_registered", False)
    versions = (source.name, ascend_plugin.SUPPORTED[source.name])
    monkeypatch.setattr(ascend_plugin, "installed_versions", lambda: versions)
    _purge_vllm_ascend()
    yield tmp_path
    _purge_vllm_ascend()


class FakeSpeculativeConfig:
    def __init__(self, method: str, model: str | None, k: int = 3) -> None:
        self.method, self.model, self.num_speculative_tokens = method, model, k

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp", "dflash")

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def uses_extract_hidden_states(self) -> bool:
        return self.method == "extract_hidden_states"

    def use_ngram_gpu(self) -> bool:
        return self.method == "ngram_gpu"

    def use_step3p5_mtp(self) -> bool:
        return False


PATTERN = [1, 2, 3, 4, 5] * 8


def _vllm_config(method: str) -> Any:
    spec = FakeSpeculativeConfig(method, PROPOSER_CLASS if method == "custom_class" else None)
    return SimpleNamespace(speculative_config=spec, additional_config={"samrollout": {"threshold_mode": "off"}},
                           model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100))


def _new_runner(runner_cls: type, method: str) -> Any:
    """A runner of ``runner_cls`` holding two greedy requests: a repetitive one and one that never repeats."""
    runner = object.__new__(runner_cls)
    runner.vllm_config = _vllm_config(method)
    runner.speculative_config = runner.vllm_config.speculative_config
    runner.device = "npu:0"
    runner.input_batch = SimpleNamespace(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, num_prompt_tokens=np.array([10, 4]),
        num_tokens_no_spec=np.array([10, 4]), token_ids_cpu=np.zeros((2, 64), dtype=np.int32))
    runner.input_batch.token_ids_cpu[0, :10] = PATTERN[:10]
    runner.input_batch.token_ids_cpu[1, :4] = [7, 8, 9, 10]
    runner.requests = {r: SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0, extra_args=None))
                       for r in "ab"}
    return runner


def _sample(batch: Any, step: int) -> list[list[int]]:
    """One step's sampled tokens, booked as _bookkeeping_sync books them; row 1 is a partial prefill at step 1."""
    sampled: list[list[int]] = []
    for row, length in enumerate(batch.num_tokens_no_spec.tolist()):
        token = PATTERN[length] if row == 0 else 20 + step
        if row == 1 and step == 1:
            sampled.append([])
            continue
        batch.token_ids_cpu[row, length] = token
        batch.num_tokens_no_spec[row] = length + 1
        sampled.append([token])
    return sampled


def _propose(runner: Any, sampled: list[list[int]]) -> Any:
    # The positional call sample_tokens makes; only the sampled tokens matter to a custom_class proposer.
    return runner.propose_draft_token_ids(sampled, None, None, None, None, None, 1, None, None, None, None)


class GPUModelRunner:
    """What vLLM's GPU runner does with a custom_class proposer (vllm/v1/worker/gpu_model_runner.py)."""

    def __init__(self, template: Any) -> None:
        vars(self).update(vars(template))
        from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer

        self.drafter = create_custom_proposer(self.vllm_config)

    def propose_draft_token_ids(self, sampled: list[list[int]], *args: Any) -> Any:
        return self.drafter.propose(sampled, self.input_batch.num_tokens_no_spec, self.input_batch.token_ids_cpu,
                                    slot_mappings=None)


def test_without_the_plugin_vllm_ascend_rejects_custom_class(stand_in_vllm_ascend: Path) -> None:
    runner_module = importlib.import_module(ascend_plugin.RUNNER_MODULE)
    runner = _new_runner(runner_module.NPUModelRunner, "custom_class")
    with pytest.raises(ValueError, match="Unknown speculative decoding method: custom_class"):
        runner._get_drafter()
    runner.drafter = SamProposer(runner.vllm_config, runner)
    with pytest.raises(ValueError, match="Unknown speculative decoding method: custom_class"):
        _propose(runner, _sample(runner.input_batch, 0))


def test_plugin_makes_vllm_ascend_draft_with_sam_proposer_like_vllm_does(stand_in_vllm_ascend: Path) -> None:
    ascend_plugin.register()
    ascend_plugin.register()  # idempotent: one hook
    assert sum(isinstance(f, ascend_plugin._PatchAfterImport) for f in sys.meta_path) == 1
    runner_module = importlib.import_module(ascend_plugin.RUNNER_MODULE)  # the hook patches it here
    spec_decode = sys.modules[ascend_plugin.SPEC_DECODE_MODULE]
    assert ascend_plugin.is_patched(runner_module.get_spec_decode_method)
    assert ascend_plugin.is_patched(spec_decode.get_spec_decode_method)
    assert ascend_plugin.is_patched(runner_module.NPUModelRunner.propose_draft_token_ids)
    assert not ascend_plugin.patch_model_runner(runner_module.NPUModelRunner)  # idempotent
    assert not ascend_plugin.patch_spec_decode_method(runner_module)

    npu = _new_runner(runner_module.NPUModelRunner, "custom_class")
    npu.drafter = npu._get_drafter()  # real _get_drafter -> patched get_spec_decode_method -> SamProposer
    assert isinstance(npu.drafter, SamProposer) and isinstance(npu.drafter, ascend_plugin.NpuDrafterHooks)
    assert npu.drafter.runner is npu  # found on the call stack, as vLLM's create_custom_proposer leaves it to
    gpu = GPUModelRunner(_new_runner(runner_module.NPUModelRunner, "custom_class"))

    drafts = []
    for step in range(6):
        on_npu = _propose(npu, _sample(npu.input_batch, step))
        assert on_npu == gpu.propose_draft_token_ids(_sample(gpu.input_batch, step))
        drafts.append(on_npu)
    assert drafts[-1][0] == PATTERN[16:19] and drafts[1][1] == []  # row 0 repeats itself; row 1 was a partial prefill

    extension = SamWorkerExtension()
    extension.model_runner = npu
    stats = extension.samrollout_drafter_stats()
    assert stats is not None and ProposerStats.from_json(stats).steps == 6

    with pytest.raises(TypeError, match="list"):
        _propose(npu, np.zeros((2, 1)))


def test_plugin_leaves_vllm_ascend_methods_to_vllm_ascend(stand_in_vllm_ascend: Path) -> None:
    ascend_plugin.register()
    runner_module = importlib.import_module(ascend_plugin.RUNNER_MODULE)
    runner = _new_runner(runner_module.NPUModelRunner, "ngram")
    runner.drafter = runner._get_drafter()
    assert type(runner.drafter).__name__ == "AscendNgramProposer"
    assert runner.drafter.args == (runner.vllm_config, runner)
    sampled = _sample(runner.input_batch, 0)
    assert _propose(runner, sampled) == [[-1]]
    assert runner.drafter.calls == [((sampled,), {})]  # vllm-ascend's own call for vLLM 0.23.0
    runner.drafter = None
    assert _propose(runner, sampled) is None  # not the last PP rank: no drafter


def test_plugin_patches_a_runner_module_imported_before_it(stand_in_vllm_ascend: Path) -> None:
    runner_module = importlib.import_module(ascend_plugin.RUNNER_MODULE)
    ascend_plugin.register()
    assert ascend_plugin.is_patched(runner_module.NPUModelRunner.propose_draft_token_ids)
    assert not any(isinstance(f, ascend_plugin._PatchAfterImport) for f in sys.meta_path)


def test_plugin_leaves_an_unexpected_runner_module_importable(stand_in_vllm_ascend: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    path = stand_in_vllm_ascend / "vllm_ascend" / "worker" / "model_runner_v1.py"
    path.write_text(path.read_text().replace(f"class {ascend_plugin.RUNNER_CLASS}:", "class SomethingElse:"))
    with plugin_log(caplog):
        ascend_plugin.register()
        module: ModuleType = importlib.import_module(ascend_plugin.RUNNER_MODULE)
    assert hasattr(module, "SomethingElse")
    assert "could not patch" in caplog.text
