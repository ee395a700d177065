"""Calibrate the RL-loop simulator on the CPU engine: simulated against measured samples/s, loop by loop.

    python bench/simulator_rl_calibration.py --servers 2 --rounds 3 \\
        --cost-args "--lengths 64,256,768 --batches 1,2,4,8,16,32 --qs 1" \\
        --bench-args "--steps 4 --groups 4 --group-size 8 --max-tokens 128" \\
        --json bench/results/simulator-rl-calibration-cpu.json

(``--qs 1``: one draft length is enough where nothing drafts, as with the bench's seeded samples.)

In one run on this machine (nothing reused from another run):

1. the CPU cost table through the server's engine (``bench/engine_cost.py --engine server``), its
   threads bound to one core when the bench runs several servers (as each of them is);
2. ``bench/async_rollout.py`` with ``--servers`` servers and ``--rounds`` interleaved rounds of its
   modes (``sync-wait``, ``sync-abort``, ``async-continue``), recording every group each round ran;
3. each round simulated (`samrollout.sim.rl_loop`) on its own recorded tokens: the same groups in the
   order the client started them, each on the server it ran on; the server's CPU defaults (length-aware
   scheduling; SAM drafts for none of the bench's seeded samples on the CPU engine, so none here); its
   slots; the bench's trainer sleep, steps, batch, over-sampling and concurrency; a weight update
   pausing the engines for the median update time the round measured (the trainer's call, which a
   ``continue`` update makes longer than a ``wait`` one; its KV recompute is charged on top, from the
   cost table); and the cost table.  Responses the loop aborted (``sync-abort``) are padded with random
   tokens to ``--max-tokens``: their true length is unknown, and longer than the time they ran.

Prints and writes, per mode, the measured samples/s (median of the rounds, and each round), the
simulated one (median of the rounds simulated on their own tokens), ``error`` (simulated / measured - 1)
and whether the ranking of the modes is kept.  ``--measured DIR`` redoes the simulated half from an
earlier run's directory (its ``measured.json``, ``engine-cost.json`` and recordings), such as the
one kept beside the report: ``--measured bench/results/simulator-rl-calibration-cpu-measured``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from harness import write_json
from simulator_calibration import ranking_kept

HERE = Path(__file__).resolve().parent
VOCAB = 49152  # SmolLM2's


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def load_recording(path: Path, max_tokens: int, seed: int) -> list[Any]:
    """A recorded round as the simulator's stream: each group with its prompt, responses and server."""
    from samrollout.sim.rl_loop import LoopGroup

    rng = np.random.default_rng(seed)
    stream: list[LoopGroup] = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            responses = []
            for tokens, reason in zip(row["response_ids"], row["finish_reasons"], strict=True):
                if reason == "abort":  # cut short: its true length is unknown, and longer
                    tokens = [*tokens, *rng.integers(0, VOCAB, max(0, max_tokens - len(tokens))).tolist()]
                responses.append(np.asarray(tokens or [0], dtype=np.int32))
            stream.append(LoopGroup(len(stream), len(stream), 0, np.asarray(row["prompt_ids"], dtype=np.int32),
                                    tuple(responses), home=row["server"]))
    return stream


def simulate_round(mode: str, stream: list[Any], measured: dict[str, Any], round_index: int, cost_path: Path,
                   checkpoint_bytes: int) -> dict[str, Any]:
    """One measured round of one mode, simulated on its own tokens."""
    from samrollout.sim.command import drafter_factory, mode_settings
    from samrollout.sim.cost import CostTable
    from samrollout.sim.rl_loop import LoopSettings, UpdateCosts, simulate_loop
    from samrollout.sim.state import SimSettings

    settings = measured["settings"]
    pause = median(measured["rounds"][mode][round_index]["update_s"])
    updates = UpdateCosts(checkpoint_bytes=checkpoint_bytes, transfer="shared-disk",
                          disk_gbyte_s=checkpoint_bytes / pause / 1e9)
    loop = LoopSettings(loop=mode, steps=settings["steps"], batch_groups=settings["groups"],  # type: ignore[arg-type]
                        train_s=measured["train_s"], oversample=settings["oversample"],
                        max_staleness=settings["max_staleness"],
                        max_concurrent_groups=settings["max_concurrent_groups"], updates=updates)
    kind, k, config, scheduling = mode_settings("samrollout", "cpu")
    # The bench samples at temperature > 0 with a seed per sample, which the CPU engine does not draft for (a
    # seed must give the same output whatever else ran): the server's scheduling, no drafter.
    drafts = settings["temperature"] == 0 or settings["seed"] is None
    sim = SimSettings(slots=settings["max_num_seqs"], instances=settings["servers"], scheduling=scheduling)
    result = simulate_loop(stream, drafter_factory(kind, VOCAB, config, "cpu") if drafts else None,
                           k if drafts else 1, CostTable.load(cost_path), sim, loop, mode)
    return result.as_dict()


def compare(mode: str, measured_rounds: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's measured rounds against its simulated rounds."""
    rates = [r["samples_per_s"] for r in measured_rounds]
    simulated_rates = [r["samples_per_s"] for r in simulated]
    return {"measured": median(rates), "measured_rounds": rates, "measured_range": [min(rates), max(rates)],
            "simulated": median(simulated_rates), "simulated_rounds": simulated_rates,
            "error": median(simulated_rates) / median(rates) - 1,
            "round_errors": [s / m - 1 for s, m in zip(simulated_rates, rates, strict=True)],
            "measured_rollout_s": median(x for r in measured_rounds for x in r["rollout_s"]),
            "simulated_rollout_s": median(x for r in simulated for x in r["step_rollout_s"]),
            "measured_recomputed_tokens": median(r["server"].get("recomputed_tokens", 0.0) for r in measured_rounds),
            "simulated_recomputed_tokens": median(r["recomputed_tokens"] for r in simulated),
            "simulated_mal": median(r["mean_acceptance_length"] for r in simulated)}


def measure(args: argparse.Namespace, work: Path) -> None:
    """Steps 1 and 2: the cost table and the bench's rounds, into ``work``."""
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0"} if args.servers > 1 else None
    _run([sys.executable, str(HERE / "engine_cost.py"), "--engine", "server", *args.cost_args.split(),
          "--json", str(work / "engine-cost.json")], env=bind)
    _run([sys.executable, str(HERE / "async_rollout.py"), "--servers", str(args.servers), "--rounds",
          str(args.rounds), "--record", str(work / "recordings"), "--json", str(work / "measured.json"),
          *args.bench_args.split()])


def main() -> None:
    """Measure (or read) the cost table and the rounds, simulate every round, print and write the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench-args", default="", help="more bench/async_rollout.py flags")
    parser.add_argument("--cost-args", default="--lengths 64,256,768 --batches 1,2,4,8,16,32 --qs 1,2,3,4",
                        help="bench/engine_cost.py grid")
    parser.add_argument("--measured", type=Path, help="an earlier run's directory: simulate it again")
    parser.add_argument("--keep", type=Path, help="keep the run's directory here (the recordings are large)")
    parser.add_argument("--json")
    args = parser.parse_args()
    started = time.perf_counter()
    work = args.measured or args.keep or Path(f"/tmp/simulator_rl_calibration_{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    if args.measured is None:
        measure(args, work)
    report = json.loads((work / "measured.json").read_text())
    measured = {"settings": report["settings"], "train_s": report["train_s"],
                "rounds": {mode: _rounds(report, mode) for mode in report["modes"]}}
    from samrollout.models import ensure_smollm2

    checkpoint = sum(f.stat().st_size for f in ensure_smollm2().glob("*.safetensors"))
    modes: dict[str, dict[str, Any]] = {}
    for mode, rounds in measured["rounds"].items():
        simulated = [simulate_round(mode, load_recording(work / "recordings" / f"{mode}-{i}.jsonl.gz",
                                                         report["settings"]["max_tokens"], i),
                                    measured, i, work / "engine-cost.json", checkpoint) for i in range(len(rounds))]
        modes[mode] = compare(mode, rounds, simulated)
    ranking = ranking_kept(modes, "measured", "measured_range", "simulated")
    print(f"\n{'mode':<16}{'measured samples/s':>19}{'rounds':>22}{'simulated':>11}{'error':>8}"
          f"{'rollout s m/s':>15}{'recomputed m/s':>18}")
    for mode, row in modes.items():
        rounds_text = ",".join(f"{r:.2f}" for r in row["measured_rounds"])
        print(f"{mode:<16}{row['measured']:>19.3f}{rounds_text:>22}{row['simulated']:>11.3f}{row['error']:>+8.1%}"
              f"{row['measured_rollout_s']:>8.1f}/{row['simulated_rollout_s']:<6.1f}"
              f"{row['measured_recomputed_tokens']:>9.0f}/{row['simulated_recomputed_tokens']:<8.0f}")
    print(f"ranking: {ranking['pairs_kept']} of {ranking['pairs_checked']} separable pairs kept"
          + (f"; broken: {ranking['pairs_broken']}" if ranking["pairs_broken"] else ""))
    result = {"command": " ".join(["bench/simulator_rl_calibration.py", *sys.argv[1:]]),
              "servers": report["settings"]["servers"], "rounds": report["settings"]["rounds"],
              "train_s": report["train_s"], "bench_settings": report["settings"],
              "cost_table": json.loads((work / "engine-cost.json").read_text()), "modes": modes,
              "ranking": ranking, "max_abs_error": max(abs(r["error"]) for r in modes.values()),
              "wall_s": time.perf_counter() - started}
    if args.json:
        write_json(args.json, result, indent=1)


def _rounds(report: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """Every round's record of a mode (the bench keeps them under ``round_records``)."""
    return list(report["modes"][mode]["round_records"])


if __name__ == "__main__":
    main()
