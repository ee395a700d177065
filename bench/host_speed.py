"""This host's single-thread speed against a named reference: what a projection charges for a drafter's CPU time.

    python bench/host_speed.py [--json bench/results/host-speed.json]

The rollout simulators measure each drafter's CPU time per step on the machine that runs them and add it to
the simulated step (`samrollout.sim.engine_step`).  That time depends on the machine and the day, so a
projection charges it at a stated speed instead: ``scale = REFERENCE_SECONDS / seconds`` measured here just
before the projection (``--drafter-time-scale``), so the charge is what the reference host would have
spent, whatever this host's speed or load that day.

The workload is fixed and independent of samrollout's code, and shaped like a drafter's per-step work:
building the published pure-Python suffix automaton over a fixed pseudo-random token stream with repeats
(dict lookups and list appends: interpreter speed), and many small numpy operations on 64-row arrays
(call overhead: what per-step policies spend).  Each part runs `ROUNDS` times; the median thread CPU time
counts (other processes' time is not counted, only contention for the core itself).

The reference host (`REFERENCE_HOST`) is this project's CI machine class, measured quiet; an H100 host's
cores are usually faster, so charging at the reference speed charges the drafters more, not less.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness import write_json

REFERENCE_HOST = "2-core AMD EPYC (avx512_bf16) virtual machine, the project's CI machine class, quiet, 2026-11-28"
REFERENCE_SECONDS = 1.05  # the workload's median thread CPU time there (two quiet runs on 2026-11-28: 1.03, 1.09 s)
ROUNDS = 5
TOKENS = 500_000


def token_stream(count: int = TOKENS, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token stream in which phrases recur (as in long reasoning text)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    phrases = [rng.integers(0, 2000, size=int(rng.integers(3, 40))).tolist() for _ in range(200)]
    while len(out) < count:
        out += phrases[int(rng.integers(0, len(phrases)))] if rng.random() < 0.6 else \
            rng.integers(0, 50_000, size=8).tolist()
    return out[:count]


def automaton_seconds(tokens: list[int]) -> float:
    """Thread CPU seconds to build the published pure-Python suffix automaton over ``tokens``."""
    from samrollout.replay.drafters import _PySam

    started = time.thread_time()
    sam = _PySam()
    for token in tokens:
        sam.extend(token)
    return time.thread_time() - started


def numpy_seconds(steps: int = 12000, rows: int = 64, depth: int = 32) -> float:
    """Thread CPU seconds for many small numpy operations on a batch's arrays (a per-step policy's overhead)."""
    rng = np.random.default_rng(1)
    values = rng.random((rows, depth))
    started = time.thread_time()
    total = 0.0
    for _ in range(steps):
        reach = np.cumprod(values, axis=1)
        order = np.argsort(-reach.ravel(), kind="stable")
        gained = np.cumsum(reach.ravel()[order])
        total += float(gained[-1]) + float(np.bincount(order[:depth] // depth, minlength=rows).sum())
    assert total > 0
    return time.thread_time() - started


def measure(rounds: int = ROUNDS) -> dict[str, Any]:
    """The workload's median thread CPU time over ``rounds`` and this host's speed against the reference."""
    tokens = token_stream()
    runs = [automaton_seconds(tokens) + numpy_seconds() for _ in range(rounds)]
    seconds = statistics.median(runs)
    return {"seconds": seconds, "runs": runs, "speed": REFERENCE_SECONDS / seconds,
            "drafter_time_scale": seconds and REFERENCE_SECONDS / seconds,
            "reference_host": REFERENCE_HOST, "reference_seconds": REFERENCE_SECONDS, "cpu": _cpu_name()}


def _cpu_name() -> str:
    """The CPU's model name, as lscpu gives it (empty where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "")


def main() -> None:
    """Measure, print, and write JSON when asked."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.rounds)
    print(f"{result['cpu']}: {result['seconds']:.3f} s (runs {', '.join(f'{r:.3f}' for r in result['runs'])}); "
          f"speed {result['speed']:.2f}x the reference ({REFERENCE_HOST}: {REFERENCE_SECONDS:.3f} s)")
    if args.json:
        write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
