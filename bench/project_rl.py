"""Project RL loops at scale on the H100 table, in one run: `samrollout simulate-rl` over the real traces.

    python bench/project_rl.py --json bench/results/projected-rl-h100.json --plot bench/results/projected-rl-h100.png

One command regenerates the whole file with one simulator version; the file records the git commit, the
command and this host's speed (`bench/host_speed.py`).  Every run of `RUNS` is a `samrollout simulate-rl` over
the real traces of ``../shared/data/reasoning-traces/``: the H100 table of a Qwen3-8B-shaped model, a KV cache
of 350,000 tokens per instance, 2 instances of 64 slots, a 16 GB checkpoint read from a shared disk, the
client's affine placement and staleness bound, and every drafter (off, vLLM `suffix`, ours; and ours at its
previous defaults, `samrollout-static`) under both fcfs and length-aware admission, synchronous and
asynchronous, each with the drafter's CPU time charged at 0 (acceptance alone) and at the reference host's
speed (``scale = reference seconds / this host's seconds``).

Sizes.  No response is ever copied, and the trace files are small, so each run takes fewer groups per step
than an epoch and holds several batches in flight, to give at least 6 asynchronous steps with at least 32
running per instance where the file allows: Sky-T1 is 30 prompts x 11 successive checkpoints' responses,
split into 2 epochs (a prompt's second epoch drafts from its first); clean: 57 groups of about 3.3, 6 per step,
20 held (about 33 running per instance, 7 async steps); all: 60 groups of 5.5, 6 per step, 12 held (about 33
per instance, 9 async steps).  R1-distill has 40 responses in all, so 32 per instance cannot be had: 20 groups
of 2, 2 per step, 6 held (6 per instance, 8 async steps), a small-batch check.  A synchronous step holds only
its batch (10-16 per instance at its start).

Each projection in the JSON has the shape the issue asks for: ``scheduling`` "like-for-like" (every drafter
under one admission policy, ``admission``) or "product" (ours at the server's defaults, length-aware, against
vLLM `suffix` and no speculation under vLLM's fcfs), and per mode ``samples_per_s``, ``tokens_per_s`` and
``steady`` (the first step left out), with the full simulation report beside them.
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

from harness import write_json

HERE = Path(__file__).resolve().parent
TRACES = HERE.parent.parent / "shared" / "data" / "reasoning-traces"
SKY = str(TRACES / "skyt1-ckpt-aime24.jsonl.gz")
R1 = str(TRACES / "r1distill-math-samples.jsonl.gz")
COMMON = ["--cost", str(HERE / "results" / "verify-cost-h100-k24.json"), "--kv-tokens", "350000", "--slots", "64",
          "--instances", "2", "--epochs", "2", "--checkpoint-gb", "16", "--placements", "affine",
          "--loops", "sync,async"]
ADMISSIONS = ("fcfs", "length-aware")
DRAFTERS = ("off", "suffix", "samrollout")
PREVIOUS = "samrollout-static"  # ours at the defaults before the adaptive policy
# (name, arguments): each a `samrollout simulate-rl` run.
RUNS: list[tuple[str, list[str]]] = [
    ("sky-clean", ["--traces", SKY, "--responses", "clean", "--batch-groups", "6", "--max-concurrent-groups", "20",
                   "--train-ratio", "0,0.5"]),
    ("sky-all", ["--traces", SKY, "--responses", "all", "--batch-groups", "6", "--max-concurrent-groups", "12",
                 "--train-ratio", "0"]),
    ("r1", ["--traces", R1, "--responses", "all", "--batch-groups", "2", "--max-concurrent-groups", "6",
            "--train-ratio", "0"]),
]
LOOP_NAMES = ("sync", "async")
KEY_MODES = tuple(f"{loop}-{drafter}" for loop in LOOP_NAMES for drafter in DRAFTERS)


def simulated_modes() -> str:
    """The `--drafters` every run simulates: each drafter under each admission, and ours' previous defaults."""
    return ",".join([f"{d}+{a}" for d in DRAFTERS for a in ADMISSIONS] + [f"{PREVIOUS}+length-aware"])


def run_one(name: str, arguments: list[str], tokenizer: str, jobs: int, scales: str, work: Path
            ) -> list[dict[str, Any]]:
    """One `samrollout simulate-rl` run; its raw projections, each tagged with the run's name and command."""
    out = work / f"{name}.json"
    command = [sys.executable, "-m", "samrollout.cli", "simulate-rl", *arguments, *COMMON, "--drafters",
               simulated_modes(), "--drafter-time-scale", scales, "--tokenizer", tokenizer, "--jobs", str(jobs),
               "--json", str(out)]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - started
    report = json.loads(out.read_text())
    shown = " ".join(a if not a.startswith(str(TRACES)) else "$R/" + Path(a).name
                     for a in [*arguments, *COMMON, "--drafters", simulated_modes(), "--drafter-time-scale", scales])
    return [{**p, "run": name, "command": f"samrollout simulate-rl {shown}", "run_wall_s": seconds}
            for p in report["projections"]]


def _entry(report: dict[str, Any]) -> dict[str, Any]:
    """One mode of a projection: the issue's figures first, the simulation's report beside them."""
    return {"samples_per_s": report["samples_per_s"], "tokens_per_s": report["tokens_per_s"],
            "mean_length": report["mean_length"], "steady": report["steady"], "report": report}


def shaped(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A raw projection as the issue's projections: one like-for-like per admission, and the product one."""
    modes = raw["modes"]
    common = {key: raw[key] for key in ("run", "command", "traces", "responses", "instances", "slots", "train_ratio",
                                        "train_s", "train_reference", "drafter_time_scale", "placement",
                                        "batch_groups", "max_concurrent_groups", "staleness", "weights", "epochs",
                                        "prompts", "stream_groups")}
    common["steps"] = {loop: len(modes[f"{loop}-off+fcfs"]["step_end_s"]) for loop in LOOP_NAMES}
    out = []
    for admission in ADMISSIONS:
        out.append({**common, "scheduling": "like-for-like", "admission": admission,
                    "modes": {f"{loop}-{d}": _entry(modes[f"{loop}-{d}+{admission}"])
                              for loop in LOOP_NAMES for d in DRAFTERS}})
    product = {f"{loop}-{d}": _entry(modes[f"{loop}-{d}+{'length-aware' if d == 'samrollout' else 'fcfs'}"])
               for loop in LOOP_NAMES for d in DRAFTERS}
    previous = {f"{loop}-{PREVIOUS}": _entry(modes[f"{loop}-{PREVIOUS}+length-aware"]) for loop in LOOP_NAMES}
    out.append({**common, "scheduling": "product", "admission": "ours length-aware, the peers fcfs",
                "modes": {**product, **previous}})
    for projection in out:
        projection["ratios"] = ratios(projection)
    return out


def ratios(projection: dict[str, Any]) -> dict[str, float | None]:
    """Ours against `suffix` and against off, in steady tokens/s, per loop; and ours against its previous
    defaults (product projections)."""
    modes = projection["modes"]

    def rate(name: str) -> float | None:
        return modes[name]["steady"]["tokens_per_s"] if name in modes else None

    out: dict[str, float | None] = {}
    for loop in LOOP_NAMES:
        ours, suffix, off = rate(f"{loop}-samrollout"), rate(f"{loop}-suffix"), rate(f"{loop}-off")
        previous = rate(f"{loop}-{PREVIOUS}")
        out[f"{loop}_ours_vs_suffix"] = ours / suffix if ours and suffix else None
        out[f"{loop}_ours_vs_off"] = ours / off if ours and off else None
        if previous:
            out[f"{loop}_ours_vs_previous"] = ours / previous if ours else None
    return out


def print_table(projections: list[dict[str, Any]]) -> None:
    """One line per projection: steady tokens/s per key mode and ours against the peers."""
    print(f"\n{'run':<10}{'resp':>6}{'train':>6}{'dt x':>6}{'scheduling':>28}"
          + "".join(f"{m:>16}" for m in KEY_MODES) + f"{'a ours/suf':>11}{'s ours/suf':>11}{'a ours/prev':>12}")
    for p in projections:
        r = p["ratios"]
        cells = "".join(f"{p['modes'][m]['steady']['tokens_per_s']:>16.1f}" for m in KEY_MODES)
        label = p["scheduling"] if p["scheduling"] == "product" else f"like-for-like {p['admission']}"
        print(f"{p['run']:<10}{p['responses']:>6}{p['train_ratio']!s:>6}{p['drafter_time_scale']:>6.2f}{label:>28}"
              f"{cells}{r['async_ours_vs_suffix'] or 0:>11.3f}{r['sync_ours_vs_suffix'] or 0:>11.3f}"
              f"{r.get('async_ours_vs_previous') or 0:>12.3f}")


def plot(projections: list[dict[str, Any]], path: Path) -> None:
    """Steady tokens/s of the key modes, one panel per run (training free, like-for-like length-aware, drafter
    time at the reference host's speed and at 0)."""
    from plotting import save, subplots

    shown = [p for p in projections if p["train_ratio"] == 0 and p["scheduling"] == "like-for-like"
             and p["admission"] == "length-aware"]
    fig, axes = subplots(1, max(1, len(shown)), figsize=(3.4 * max(1, len(shown)), 3.9), squeeze=False)
    for ax, p in zip(axes.flat, shown, strict=False):
        rates = [p["modes"][m]["steady"]["tokens_per_s"] for m in KEY_MODES]
        ax.bar(range(len(KEY_MODES)), rates, color=["#999999", "#cc7744", "#3377bb"] * 2)
        ax.set_xticks(range(len(KEY_MODES)), [m.replace("samrollout", "ours") for m in KEY_MODES], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(f"{p['run']} {p['responses']}, drafter x{p['drafter_time_scale']:.2f}", fontsize=8)
    axes.flat[0].set_ylabel("steady tokens / s to the trainer (projected, H100)")
    save(fig, path)


def main() -> None:
    """Measure the host's speed, run every projection, shape, print, write."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(name for name, _ in RUNS), help="which of RUNS")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tokenizer", help="default: the built-in model's (`samrollout model smollm2`)")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "projected-rl-h100.json")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from host_speed import measure
    from provenance import builtin_tokenizer, command_line, git_commit

    args.tokenizer = builtin_tokenizer(args.tokenizer)
    commit = git_commit()
    host = measure()
    scale = host["drafter_time_scale"]
    print(f"host speed: {host['seconds']:.3f} s against the reference's {host['reference_seconds']:.3f} s "
          f"({host['reference_host']}): drafter time charged x{scale:.3f} and x0", flush=True)
    wanted = set(args.runs.split(","))
    projections: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        for name, arguments in RUNS:
            if name in wanted:
                for raw in run_one(name, arguments, args.tokenizer, args.jobs, f"0,{scale:.4f}", Path(work)):
                    projections += shaped(raw)
    write_json(args.json, {"commit": commit, "command": command_line("project_rl.py"), "host_speed": host,
                           "projections": projections}, indent=1)
    print_table(projections)
    if args.plot:
        plot(projections, args.plot)


if __name__ == "__main__":
    main()
