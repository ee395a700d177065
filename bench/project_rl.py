"""Project RL loops at scale on the H100 table: `samrollout simulate-rl` over the real traces, merged into one report.

    python bench/project_rl.py --json bench/results/projected-rl-h100.json --plot bench/results/projected-rl-h100.png

Runs `samrollout simulate-rl` once per line of `RUNS` (the real traces of ``../shared/data/reasoning-traces/``,
the H100 table of a Qwen3-8B-shaped model, a KV cache of 350,000 tokens per instance, a 16 GB checkpoint),
merges their projections into one JSON (``{"projections": [...]}``, each with its command) and prints, per
projection, samples/s of sync + off, sync + suffix, sync + ours, async + off, async + suffix and async + ours,
with the two ratios the issue's targets name: async + ours against sync + off, and against async + suffix.

Sizes (what the trace files support without copying a response): Sky-T1 has 30 prompts x 11 checkpoints'
responses (190 clean), split into 2 epochs of successive checkpoints; a step takes 15 groups (82 responses
on all, about 50 clean), so each of 2 instances starts a sync step with about 41 running (all) or 25 (clean),
and an async step, which holds two batches, with twice that.  R1-distill's 10 x 4 responses make 2 epochs
of 10 groups of 2: a small check only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRACES = HERE.parent.parent / "shared" / "data" / "reasoning-traces"
SKY = str(TRACES / "skyt1-ckpt-aime24.jsonl.gz")
R1 = str(TRACES / "r1distill-math-samples.jsonl.gz")
COMMON = ["--cost", str(HERE / "results" / "verify-cost-h100-k24.json"), "--kv-tokens", "350000", "--slots", "64",
          "--epochs", "2", "--checkpoint-gb", "16"]
# (name, arguments): each a `samrollout simulate-rl` run.
RUNS: list[tuple[str, list[str]]] = [
    ("sky-clean", ["--traces", SKY, "--responses", "clean", "--instances", "2", "--batch-groups", "15",
                   "--train-ratio", "0,0.5,1", "--max-staleness", "1,2", "--placements", "affine,least-outstanding"]),
    ("sky-all", ["--traces", SKY, "--responses", "all", "--instances", "2", "--batch-groups", "15",
                 "--train-ratio", "0,0.5", "--max-staleness", "1", "--placements", "affine,least-outstanding"]),
    ("sky-clean-push-halved", ["--traces", SKY, "--responses", "clean", "--instances", "2", "--batch-groups", "15",
                               "--train-ratio", "0.5", "--max-staleness", "1", "--placements", "affine",
                               "--weights", "push,push-fanout", "--drafter-time-scale", "0.5"]),
    ("sky-clean-draft-range", ["--traces", SKY, "--responses", "clean", "--instances", "2", "--batch-groups", "15",
                               "--train-ratio", "0", "--max-staleness", "1", "--placements", "affine",
                               "--loops", "async", "--drafters",
                               "samrollout,samrollout-r32.8-r256.5,samrollout-r32.8-r256.8,samrollout-p0.8"]),
    # Draft length at full batch: the defaults against up to 16 tokens at every batch size, capped by the match.
    ("sky-draft-length", ["--traces", SKY, "--responses", "both", "--instances", "2", "--batch-groups", "15",
                          "--train-ratio", "0", "--max-staleness", "1", "--placements", "affine", "--drafters",
                          "suffix,samrollout,samrollout-r256.16-s100,samrollout-r256.16-s50,"
                          "samrollout-r32.8-r256.16-s100"]),
    ("r1-draft-length", ["--traces", R1, "--responses", "all", "--instances", "2", "--batch-groups", "5",
                         "--train-ratio", "0", "--max-staleness", "1", "--placements", "affine", "--drafters",
                         "suffix,samrollout,samrollout-r256.16-s100,samrollout-r32.8-r256.16-s100"]),
    ("r1-small", ["--traces", R1, "--responses", "all", "--instances", "2", "--batch-groups", "5",
                  "--train-ratio", "0,0.5", "--max-staleness", "1", "--placements", "affine,least-outstanding"]),
]
KEY_MODES = ("sync-off", "sync-suffix", "sync-samrollout", "async-off", "async-suffix", "async-samrollout")


def run_one(name: str, arguments: list[str], tokenizer: str, jobs: int, work: Path) -> list[dict[str, Any]]:
    """One `samrollout simulate-rl` run; its projections, each tagged with the run's name and command."""
    out = work / f"{name}.json"
    command = [sys.executable, "-m", "samrollout.cli", "simulate-rl", *arguments, *COMMON, "--tokenizer", tokenizer,
               "--jobs", str(jobs), "--json", str(out)]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - started
    report = json.loads(out.read_text())
    shown = " ".join(a if not a.startswith(str(TRACES)) else "$R/" + Path(a).name for a in arguments + COMMON)
    return [{**p, "run": name, "command": f"samrollout simulate-rl {shown}", "run_wall_s": seconds}
            for p in report["projections"]]


def ratios(projection: dict[str, Any]) -> dict[str, float | None]:
    """The targets' ratios of one projection (None where a mode is missing)."""
    modes = projection["modes"]

    def rate(name: str) -> float | None:
        return modes[name]["samples_per_s"] if name in modes else None

    ours, off, suffix = rate("async-samrollout"), rate("sync-off"), rate("async-suffix")
    return {"async_ours_vs_sync_off": ours / off if ours and off else None,
            "async_ours_vs_async_suffix": ours / suffix if ours and suffix else None,
            "sync_ours_vs_sync_suffix": (rate("sync-samrollout") or 0) / (rate("sync-suffix") or 1)}


def print_table(projections: list[dict[str, Any]]) -> None:
    """One line per projection: samples/s per key mode and the targets' ratios."""
    print(f"\n{'run':<24}{'resp':>6}{'inst':>5}{'placement':>19}{'weights':>13}{'dt x':>5}{'train':>6}{'stale':>6}"
          + "".join(f"{m:>17}" for m in KEY_MODES) + f"{'a-ours/s-off':>13}{'a-ours/a-suf':>13}")
    for p in projections:
        r = p["ratios"]
        cells = "".join(f"{p['modes'][m]['samples_per_s']:>17.4f}" if m in p["modes"] else f"{'-':>17}"
                        for m in KEY_MODES)
        print(f"{p['run']:<24}{p['responses']:>6}{p['instances']:>5}{p['placement']:>19}{p['weights']:>13}"
              f"{p['drafter_time_scale']:>5}{p['train_ratio']!s:>6}{p['staleness']!s:>6}{cells}"
              f"{r['async_ours_vs_sync_off'] or 0:>13.2f}{r['async_ours_vs_async_suffix'] or 0:>13.2f}")


def plot(projections: list[dict[str, Any]], path: Path) -> None:
    """Samples/s of the key modes, one panel per run and training ratio (affine, staleness 1, shared disk, every
    key mode run)."""
    from plotting import save, subplots

    shown = [p for p in projections if p["placement"] == "affine" and p["staleness"] == 1
             and p["weights"] == "shared-disk" and set(KEY_MODES) <= set(p["modes"])]
    fig, axes = subplots(1, max(1, len(shown)), figsize=(3.2 * max(1, len(shown)), 3.8), squeeze=False)
    for ax, p in zip(axes.flat, shown, strict=False):
        rates = [p["modes"][m]["samples_per_s"] if m in p["modes"] else 0.0 for m in KEY_MODES]
        ax.bar(range(len(KEY_MODES)), rates, color=["#999999", "#cc7744", "#3377bb"] * 2)
        ax.set_xticks(range(len(KEY_MODES)), [m.replace("samrollout", "ours") for m in KEY_MODES], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(f"{p['run']} train {p['train_ratio']}", fontsize=8)
    axes.flat[0].set_ylabel("samples / s (projected, H100)")
    save(fig, path)


def main() -> None:
    """Run every projection, merge, print, write."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(name for name, _ in RUNS), help="which of RUNS")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tokenizer", help="default: the built-in model's (`samrollout model smollm2`)")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "projected-rl-h100.json")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--append", action="store_true",
                        help="keep the projections of other runs already in --json (a run named again is replaced)")
    args = parser.parse_args()
    if args.tokenizer is None:
        from samrollout.models import ensure_smollm2

        args.tokenizer = str(ensure_smollm2())
    wanted = set(args.runs.split(","))
    projections: list[dict[str, Any]] = []
    if args.append and args.json.exists():
        projections = [p for p in json.loads(args.json.read_text())["projections"] if p["run"] not in wanted]
    with tempfile.TemporaryDirectory() as work:
        for name, arguments in RUNS:
            if name in wanted:
                projections += run_one(name, arguments, args.tokenizer, args.jobs, Path(work))
                for p in projections:
                    p["ratios"] = ratios(p)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"command": " ".join(["bench/project_rl.py", *sys.argv[1:]]),
                                                 "projections": projections}, indent=1) + "\n")
    print_table(projections)
    if args.plot:
        plot(projections, args.plot)


if __name__ == "__main__":
    main()
