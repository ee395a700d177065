"""The CPU engine defaults: float32 where bf16 is emulated, eager mode, worker threads on every core of a
small machine, chunked prefill on; each overridable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from samrollout.cpu_defaults import (
    THREADS_BIND_ENV,
    cpu_dtype,
    cpu_flags,
    place_cpu_worker_threads,
    usable_cores,
    worker_threads_bind,
)
from samrollout.server.engine.vllm_argv import vllm_argv
from samrollout.server.settings import ServerSettings

AVX2 = frozenset({"fpu", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16"}


def test_auto_dtype_is_float32_on_a_cpu_without_native_bfloat16() -> None:
    assert cpu_dtype("auto", AVX2) == "float32"
    assert cpu_dtype("auto", SAPPHIRE_RAPIDS) == "auto"  # the model's own dtype where bf16 is native
    assert cpu_dtype("bfloat16", AVX2) == "bfloat16"  # an explicit choice is kept


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_a_small_machine_binds_the_worker_to_every_core_unless_the_user_chose() -> None:
    assert worker_threads_bind({}, [0, 1]) == "0,1"
    assert worker_threads_bind({THREADS_BIND_ENV: "0"}, [0, 1]) is None
    assert worker_threads_bind({}, list(range(32))) is None  # vLLM's own placement on big machines


def test_placing_the_worker_threads_sets_the_binding_and_keeps_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the server and `build_llm` / `build_async_engine` run before vLLM spawns its worker."""
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    expected = worker_threads_bind({}, usable_cores())
    assert place_cpu_worker_threads() == expected
    assert os.environ.get(THREADS_BIND_ENV) == expected
    monkeypatch.setenv(THREADS_BIND_ENV, "0")
    assert place_cpu_worker_threads() is None and os.environ[THREADS_BIND_ENV] == "0"  # the user's value wins


def test_cpu_engines_run_eager_with_chunked_prefill_unless_asked_otherwise() -> None:
    argv = vllm_argv(ServerSettings(), "/m", "cpu")
    assert "--enforce-eager" in argv
    assert "--no-enable-chunked-prefill" not in argv
    assert argv[argv.index("--dtype") + 1] == cpu_dtype("auto")
    assert "--enforce-eager" not in vllm_argv(ServerSettings(compile=True), "/m", "cpu")
    assert "--enforce-eager" not in vllm_argv(ServerSettings(), "/m", "cuda")
    assert "--no-enable-chunked-prefill" in vllm_argv(ServerSettings(chunked_prefill=False), "/m", "cpu")
    assert vllm_argv(ServerSettings(dtype="bfloat16"), "/m", "cpu")[argv.index("--dtype") + 1] == "bfloat16"
