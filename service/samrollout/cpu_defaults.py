"""Engine defaults for vLLM's CPU backend: dtype, torch compile, and where the worker's threads run.

Measured on a 2-core AMD EPYC (AVX2, no native bfloat16) with the built-in SmolLM2-135M,
`bench/http_overhead.py` (docs/tuning.md, "Served speed on CPU"):

- **dtype**: without native bfloat16 (AVX512-BF16 or AMX) oneDNN cannot build a bf16
  matmul and vLLM falls back to a slow bf16 ``torch.nn.functional.linear``: 30 tokens/s at
  16 concurrent requests against 125 in float32.  ``auto`` on such a CPU means float32;
  where the CPU has native bf16, the model's own dtype.
- **torch compile**: vLLM's inductor warm-up took 4-9 minutes on the first start (about
  30 s with eager mode) and gave no measured gain on this model; on CPU it is off unless
  asked for (``--compile``).
- **threads**: vLLM's ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds the worker's OpenMP threads
  to one NUMA node and reserves one core for the scheduler process.  On a small machine
  that reservation is a large share: on 2 cores it leaves the worker one, at 125 tokens/s
  (16 concurrent) against 185 with both.  Below `SMALL_MACHINE_CORES` allowed cores the
  server binds the worker to all of them; a ``VLLM_CPU_OMP_THREADS_BIND`` set by the user
  always wins.  The server and the Python API's engine builders (`samrollout.engine`) both
  apply it (`place_cpu_worker_threads`).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

# CPU feature flags (Linux /proc/cpuinfo names) that give oneDNN native bfloat16 matmuls.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # bf16: AArch64's "Features" name
# Below this many usable cores, reserving one for vLLM's scheduler costs the worker too much.
SMALL_MACHINE_CORES = 8
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags`` or AArch64 ``Features``); empty where unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (else bf16 models run far slower than float32)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def cpu_dtype(requested: str, flags: frozenset[str] | None = None) -> str:
    """The dtype to run on CPU: ``auto`` becomes float32 without native bfloat16; explicit choices stay."""
    if requested == "auto" and not has_native_bf16(flags):
        return "float32"
    return requested


def usable_cores() -> list[int]:
    """The CPU ids this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def worker_threads_bind(environ: dict[str, str] | None = None, cores: list[int] | None = None) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value to set, or None to leave vLLM's choice (or the user's) alone."""
    environ = dict(os.environ) if environ is None else environ
    if environ.get(THREADS_BIND_ENV):
        return None
    cores = usable_cores() if cores is None else cores
    if len(cores) >= SMALL_MACHINE_CORES:
        return None
    return ",".join(str(core) for core in cores)


def place_cpu_worker_threads() -> str | None:
    """On a small CPU machine, let the worker's threads use every core (`worker_threads_bind`); call before the
    engine starts its processes.  Returns the binding set, if any."""
    bind = worker_threads_bind()
    if bind is not None:
        os.environ[THREADS_BIND_ENV] = bind
        logging.getLogger("samrollout.cpu").info("CPU worker threads on cores %s (%s=%s; set it to override)",
                                                 bind, THREADS_BIND_ENV, bind)
    return bind
