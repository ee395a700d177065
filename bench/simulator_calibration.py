"""Calibrate the rollout simulator on the CPU engine: simulated against measured makespans, mode by mode.

    python bench/simulator_calibration.py --rounds 3 --json bench/results/simulator-calibration-cpu.json \\
        --plot bench/results/simulator-calibration-cpu.png

In one run on this machine (which drifts by 20% and more within an hour, so nothing is reused from
another run):

1. the CPU cost table, measured through the real vLLM engine (``bench/engine_cost.py``);
2. the ``bench/spec_engine.py`` rollout (32 greedy requests in 8 groups of 4, heavy-tailed lengths)
   for every mode, ``--rounds`` interleaved rounds, the median makespan taken;
3. the same rollout simulated (`samrollout.sim.rollout`) for every mode and round: that run's own
   tokens (greedy in bf16 on this CPU is not batch-invariant, so a mode's outputs part from the
   others' after a few tokens: verifying drafts changes the batch shapes, and the tokens the
   drafters saw are that run's own), the engine's slots, the mode's drafter
   (ours through the engine's `DraftSession` with the mode's `SpeculationConfig`; vLLM's ngram and
   suffix through the replay's peers, at the bench's k) and the cost table.

Prints and writes, per mode, ``measured_s`` (median of the rounds), its range, ``simulated_s`` (median
of the rounds simulated on their own tokens) and ``error`` (simulated / measured - 1), and whether
the ranking of modes is kept wherever two modes' measured medians differ by more than their
round-to-round spread.  With ``--json``, the measured rounds (every request's tokens) are kept next
to it as ``<name>-measured.json.gz``, so the simulated half can be redone in seconds
when the simulator changes::

    python bench/simulator_calibration.py --cost bench/results/simulator-calibration-cpu.json \
        --measured bench/results/simulator-calibration-cpu-measured.json.gz \
        --json bench/results/simulator-calibration-cpu.json --plot bench/results/simulator-calibration-cpu.png
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from harness import write_json
from plotting import save, subplots

HERE = Path(__file__).resolve().parent
DEFAULT_MODES = "off,suffix,sam-static,sam-default"


def _spec_engine() -> Any:
    """bench/spec_engine.py as a module (its MODES say how each mode configures the engine)."""
    spec = importlib.util.spec_from_file_location("spec_engine", HERE / "spec_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def mode_plan(mode: str, k: int, threshold: int) -> tuple[str, Any]:
    """(drafter kind, our SpeculationConfig or None) for a spec_engine mode, configured as that bench does."""
    from samrollout.config import SpeculationConfig
    from samrollout.drafter import DraftPolicy

    setting = _spec_engine().MODES[mode]
    if setting is None:
        return "off", None
    if setting["method"] in ("ngram", "suffix"):
        return setting["method"], None
    if setting.get("server_defaults"):  # as the server configures a CPU engine
        from samrollout.server.settings import ServerSettings

        return "sam", ServerSettings(k=k, threshold=threshold).speculation_config("cpu")
    policy = DraftPolicy(min_match_length=setting.get("min_match_length", "auto"),
                         max_global_tokens=setting.get("max_global_tokens", DraftPolicy.max_global_tokens))
    return "sam", SpeculationConfig(k=k, threshold_mode=setting["threshold_mode"], threshold=threshold,
                                    policy=policy,
                                    confident_match=setting.get("confident_match", SpeculationConfig.confident_match))


def simulate_mode(mode: str, traces: Path, cost_path: Path, slots: int, k: int, threshold: int,
                  tail: int) -> dict[str, Any]:
    """The simulated rollout of one mode on the engine's own tokens."""
    from samrollout.replay.drafters import SamReplayDrafter
    from samrollout.replay.registry import make_drafter
    from samrollout.replay.traces import load_traces, vocab_size
    from samrollout.sim.cost import CostTable
    from samrollout.sim.rollout import SimSettings, simulate

    groups = load_traces(str(traces), None)
    vocab = max(vocab_size(groups), 49152)
    kind, config = mode_plan(mode, k, threshold)
    factory: Any = None
    if kind == "sam":
        factory = lambda: SamReplayDrafter.as_engine(mode, vocab, config, on_cpu=True)  # noqa: E731
    elif kind == "ngram":
        factory = lambda: make_drafter("ngram", vocab)  # noqa: E731
    elif kind == "suffix":
        factory = lambda: make_drafter("suffix-cache", vocab)  # noqa: E731
    largest = config.largest_draft() if config is not None else k
    result = simulate(groups, factory, largest, CostTable.load(cost_path), SimSettings(slots=slots, tail_rows=tail),
                      mode)
    return result.as_dict()


def read_text(path: Path) -> str:
    """A JSON file's text, gzipped or not."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return handle.read()
    return path.read_text()


def write_traces(run: dict[str, Any], path: Path) -> None:
    """The rollout's requests (prompt and greedy output token ids, by prompt group) as a trace file."""
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for seq in run["rollout"]["sequences"]:
            handle.write(json.dumps({"prompt_id": seq["prompt_id"], "prompt_ids": seq["prompt_ids"],
                                     "response_ids": seq["response_ids"]}) + "\n")


def compare(summary: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's measured rounds against its simulated rounds: medians, ranges and the error."""
    rollout = summary["rollout"]
    simulated = [r["makespan_s"] for r in rounds]
    return {"measured_s": rollout["makespan_s"], "measured_range_s": rollout["makespan_range_s"],
            "measured_rounds_s": [run["rollout"]["makespan_s"] for run in summary["runs"]],
            "measured_steps": rollout["steps"], "measured_tail_s": rollout["tail_s"],
            "measured_mal": rollout["mean_acceptance_length"],  # vLLM's: per row-step that verified a draft
            "simulated_s": median(simulated), "simulated_rounds_s": simulated,
            "simulated_steps": median([r["steps"] for r in rounds]),
            "simulated_tail_s": median([r["tail_s"] for r in rounds]),
            "simulated_mal": median([r["drafted_acceptance_length"] for r in rounds]),
            "error": median(simulated) / rollout["makespan_s"] - 1,
            "round_errors": [s / run["rollout"]["makespan_s"] - 1 for s, run in zip(simulated, summary["runs"],
                                                                                   strict=True)]}


def ranking_kept(modes: dict[str, dict[str, Any]], measured: str = "measured_s", spread: str = "measured_range_s",
                 simulated: str = "simulated_s") -> dict[str, Any]:
    """Pairs whose measured medians differ by more than both modes' round spreads: is their order simulated?

    ``measured``, ``spread`` and ``simulated`` name each mode's median, its rounds' [low, high] and the
    simulated value (bench/simulator_rl_calibration.py keeps samples/s under other names)."""
    names = list(modes)
    checked, kept, broken = 0, 0, []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ma, mb = modes[a], modes[b]
            width = max(ma[spread][1] - ma[spread][0], mb[spread][1] - mb[spread][0])
            if abs(ma[measured] - mb[measured]) <= width:
                continue
            checked += 1
            if (ma[measured] < mb[measured]) == (ma[simulated] < mb[simulated]):
                kept += 1
            else:
                broken.append([a, b])
    return {"pairs_checked": checked, "pairs_kept": kept, "pairs_broken": broken}


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=8)
    parser.add_argument("--tail", type=int, default=8)
    parser.add_argument("--cost", help="use this cost table (or an earlier report's) instead of measuring one "
                        "(a calibration only with the rounds measured in the same run)")
    parser.add_argument("--cost-args",
                        default="--engine plain --lengths 64,256,768 --batches 1,2,4,8,16,32 --qs 1,2,3,4",
                        help="bench/engine_cost.py grid (plain: vLLM's defaults, as bench/spec_engine.py's engines)")
    parser.add_argument("--measured", help="use this spec_engine JSON instead of running the modes")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    return parser.parse_args()


def cost_table(args: argparse.Namespace, work: Path) -> Path:
    """The cost table's path: ``--cost`` (or the table an earlier report holds), else one measured now."""
    cost_path = Path(args.cost) if args.cost else work / "engine-cost-cpu.json"
    given = json.loads(read_text(cost_path)) if args.cost else {}
    if "cost_table" in given:  # an earlier report: the table it measured
        cost_path = work / "engine-cost-cpu.json"
        cost_path.write_text(json.dumps(given["cost_table"]))
    if not args.cost:
        _run([sys.executable, str(HERE / "engine_cost.py"), *args.cost_args.split(), "--json", str(cost_path)])
    return cost_path


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each mode's spec_engine summary: ``--measured``, else the rounds run now (kept beside ``--json``)."""
    measured_path = Path(args.measured) if args.measured else work / "spec-engine.json"
    if not args.measured:
        _run([sys.executable, str(HERE / "spec_engine.py"), "--modes", args.modes, "--repeats", str(args.rounds),
              "--batch-sizes", "", "--k", str(args.k), "--threshold", str(args.threshold), "--tail", str(args.tail),
              "--json", str(measured_path)])
    if args.json and not args.measured:
        keep = Path(args.json).with_name(Path(args.json).stem + "-measured.json.gz")
        keep.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(keep, "wt", encoding="utf-8") as handle:
            handle.write(measured_path.read_text())
    return {r["mode"]: r for r in json.loads(read_text(measured_path))["results"]}


def simulate_rounds(args: argparse.Namespace, measured: dict[str, Any], cost_path: Path,
                    work: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """Every mode's measured rounds against the same rounds simulated on their own tokens; and the slots."""
    modes: dict[str, dict[str, Any]] = {}
    slots = 0
    for mode, summary in measured.items():
        rounds = []
        for index, run in enumerate(summary["runs"]):  # each round simulated on its own tokens
            traces = work / f"rollout-{mode}-{index}.jsonl.gz"
            write_traces(run, traces)
            slots = int(run["rollout"]["max_num_seqs"])
            rounds.append(simulate_mode(mode, traces, cost_path, slots, args.k, args.threshold, args.tail))
        modes[mode] = compare(summary, rounds)
    return modes, slots


def print_table(modes: dict[str, dict[str, Any]], ranking: dict[str, Any]) -> None:
    """Per mode: measured against simulated makespan, steps and MAL; then whether the ranking is kept."""
    print(f"\n{'mode':<18}{'measured s':>11}{'range':>15}{'simulated s':>12}{'error':>8}{'steps m/s':>14}"
          f"{'MAL m/s':>12}")
    for mode, row in modes.items():
        low, high = row["measured_range_s"]
        print(f"{mode:<18}{row['measured_s']:>11.2f}{f'{low:.1f}-{high:.1f}':>15}{row['simulated_s']:>12.2f}"
              f"{row['error']:>+8.1%}{row['measured_steps']:>7.0f}/{row['simulated_steps']:<6}"
              f"{row['measured_mal']:>6.2f}/{row['simulated_mal']:<5.2f}")
    print(f"ranking: {ranking['pairs_kept']} of {ranking['pairs_checked']} separable pairs kept"
          + (f"; broken: {ranking['pairs_broken']}" if ranking["pairs_broken"] else ""))


def main() -> None:
    """Measure the cost table and the modes, simulate the modes, print and write the comparison."""
    args = parse_args()
    work = Path(f"/tmp/simulator_calibration_{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cost_path = cost_table(args, work)
    modes, slots = simulate_rounds(args, measure(args, work), cost_path, work)
    ranking = ranking_kept(modes)
    print_table(modes, ranking)
    if args.json:
        write_json(args.json, {"options": vars(args), "slots": slots, "cost_table": json.loads(read_text(cost_path)),
                               "modes": modes, "ranking": ranking,
                               "max_abs_error": max(abs(r["error"]) for r in modes.values()),
                               "wall_s": time.perf_counter() - started}, indent=1)
    if args.plot:
        plot(modes, args.plot)


def plot(modes: dict[str, dict[str, Any]], path: str) -> None:
    """Measured (rounds and median) against simulated makespan per mode."""
    fig, ax = subplots(figsize=(8, 4.5))
    names = list(modes)
    for i, name in enumerate(names):
        row = modes[name]
        ax.scatter([i] * len(row["measured_rounds_s"]), row["measured_rounds_s"], color="grey", s=12)
        ax.scatter([i], [row["measured_s"]], color="C0", marker="_", s=400, label="measured median" if i == 0 else None)
        ax.scatter([i], [row["simulated_s"]], color="C1", marker="x", s=60, label="simulated" if i == 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("rollout makespan (s)")
    ax.set_title("simulator calibration on the CPU engine (spec_engine rollout)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


if __name__ == "__main__":
    main()
