"""Project one synchronous rollout step on the H100 table, in one run: `samrollout simulate` over the real traces.

    python bench/project_step.py --json bench/results/projected-h100.json --plot bench/results/projected-h100.png

Every response of each trace file (Sky-T1 clean and all, R1-distill) in one rollout on one instance of 64 slots
(the H100 table of a Qwen3-8B-shaped model, a KV cache of 350,000 tokens), for every mode: no speculation,
vLLM `suffix` at its defaults, ours at the server's defaults (the adaptive policy) and at the defaults before
it (`samrollout-static`), each under fcfs and length-aware admission where it matters; the drafters' CPU time
charged at 0 and at the reference host's speed (`bench/host_speed.py`).  The file records the git commit,
the command and the host's speed.  Ratios are makespans: ours against `suffix` like for like (the same
admission) and as products (ours length-aware, the peers fcfs, as each ships).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import write_json

HERE = Path(__file__).resolve().parent
TRACES = HERE.parent.parent / "shared" / "data" / "reasoning-traces"
MODES = ("off+fcfs,off+length-aware,suffix+fcfs,suffix+length-aware,samrollout-static+length-aware,"
         "samrollout+fcfs,samrollout+length-aware")
COMMON = ["--cost", str(HERE / "results" / "verify-cost-h100-k24.json"), "--kv-tokens", "350000", "--slots", "64",
          "--instances", "1", "--responses", "both", "--modes", MODES]


def run(tokenizer: str, scale: float, work: Path) -> list[dict[str, Any]]:
    """One `samrollout simulate` over both trace files with the drafters charged at ``scale`` (0: not charged)."""
    out = work / f"step-{scale}.json"
    charge = ["--no-drafter-time"] if scale == 0 else ["--drafter-time-scale", f"{scale:.4f}"]
    command = [sys.executable, "-m", "samrollout.cli", "simulate", "--traces",
               f"{TRACES / 'skyt1-ckpt-aime24.jsonl.gz'},{TRACES / 'r1distill-math-samples.jsonl.gz'}",
               "--tokenizer", tokenizer, *COMMON, *charge, "--json", str(out)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    projections = json.loads(out.read_text())["projections"]
    for p in projections:
        p["drafter_time_scale"] = scale
        modes = p["modes"]

        def makespan(name: str, modes: dict[str, Any] = modes) -> float:
            return float(modes[name]["makespan_s"])

        p["ratios"] = {
            "ours_vs_suffix_like_for_like_length_aware": makespan("samrollout+length-aware")
            / makespan("suffix+length-aware"),
            "ours_vs_suffix_like_for_like_fcfs": makespan("samrollout+fcfs") / makespan("suffix+fcfs"),
            "ours_vs_suffix_product": makespan("samrollout+length-aware") / makespan("suffix+fcfs"),
            "ours_vs_off_product": makespan("samrollout+length-aware") / makespan("off+fcfs"),
            "ours_vs_previous": makespan("samrollout+length-aware") / makespan("samrollout-static+length-aware")}
    return list(projections)


def print_table(projections: list[dict[str, Any]]) -> None:
    """One line per file, filter and charge: makespans and the ratios."""
    print(f"\n{'traces':<34}{'resp':>6}{'dt x':>6}{'off':>8}{'suffix':>8}{'ours':>8}{'prev':>8}"
          f"{'x suf (prod)':>13}{'x suf (l4l)':>12}{'x off':>7}{'x prev':>8}")
    for p in projections:
        m, r = p["modes"], p["ratios"]
        print(f"{Path(p['traces']).name:<34}{p['responses']:>6}{p['drafter_time_scale']:>6.2f}"
              f"{m['off+fcfs']['makespan_s']:>8.1f}{m['suffix+fcfs']['makespan_s']:>8.1f}"
              f"{m['samrollout+length-aware']['makespan_s']:>8.1f}{m['samrollout-static+length-aware']['makespan_s']:>8.1f}"
              f"{r['ours_vs_suffix_product']:>13.3f}{r['ours_vs_suffix_like_for_like_length_aware']:>12.3f}"
              f"{r['ours_vs_off_product']:>7.3f}{r['ours_vs_previous']:>8.3f}")


def main() -> None:
    """Measure the host's speed, project with the drafters charged at 0 and at it, write and plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="default: the built-in model's (`samrollout model smollm2`)")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "projected-h100.json")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from host_speed import measure
    from provenance import builtin_tokenizer, command_line, git_commit

    args.tokenizer = builtin_tokenizer(args.tokenizer)
    commit = git_commit()
    host = measure()
    projections: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        for scale in (0.0, host["drafter_time_scale"]):
            projections += run(args.tokenizer, scale, Path(work))
    write_json(args.json, {"commit": commit, "command": command_line("project_step.py"), "host_speed": host,
                           "projections": projections}, indent=1)
    print_table(projections)
    if args.plot:
        from samrollout.sim.command import write_plot

        write_plot(str(args.plot), [p for p in projections if p["drafter_time_scale"] == 0])


if __name__ == "__main__":
    main()
