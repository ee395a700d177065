"""Project RL loops at scale on the H100 table, in one run: `samrollout simulate-rl` over the real traces.

    SAMROLLOUT_TRACES=../shared/data/reasoning-traces python bench/project_rl.py \
        --json bench/results/projected-rl-h100.json --plot bench/results/projected-rl-h100.png

One command regenerates the whole file at one commit (recorded, with the command and every run's
`samrollout simulate-rl` command); the JSON is written after each run, so a run cut short keeps what finished.
Every run: the H100 table of a Qwen3-8B-shaped model (``verify-cost-h100-k24.json``), a KV cache of 350,000
tokens per instance, a 16 GB checkpoint from a shared disk, 2 epochs of the traces (a prompt's second epoch
drafts from its first), the drafters' CPU time not charged (``--drafter-time-scale 0``), and 2 stream orders
(``--seeds 0,1``; the spread over them is reported).  The runs (`RUNS`), most important first:

- **like for like** (Sky-T1 clean, R1-distill, Sky-T1 all): 2 instances x 32 slots, affine placement, every
  drafter under length-aware admission, sync and async; vLLM `suffix` at its best (``suffix-best``: the grid
  depth {24, 64} x k {8, 16, 32} x spec factor {1, 2}, 100,000 cached requests, picked per projection in a
  quick synchronous rollout of the stream's first two steps, `samrollout.sim.suffix_best`), against ours on
  each step-cost prior (``table``: the simulator's own; ``line``: the generic line a device without a table
  gets, the headline; ``wrong-table``: draft tokens 2x costlier).  One projection per prior, ``prior`` and
  ``seed`` in it.  The scheduler comparison (fcfs against length-aware) is not made: admission barely binds
  at these sizes, so the label says only that every drafter had the same admission.
- **product** (Sky-T1 clean, async, 2 and 4 instances): ours as shipped (affine placement, length-aware,
  the adaptive policy, its CUDA prior: the shipped H100 table) against vLLM `suffix` at vLLM's defaults and
  no speculation, both behind least-outstanding with fcfs (ours behind least-outstanding too, for placement).
- **trainer-bound** (Sky-T1 clean, seed 0, training 0.5x the sync + off rollout): labelled as such; every
  drafter is expected to tie where the trainer sets the pace.

Sizes (steps: at least 9 async, so at least 8 steady intervals): Sky-T1 clean 4 groups per step, 20 held
(about 33 running per instance); all 5 per step, 12 held; R1-distill (40 responses) 2 per step, 4 held, a
small-batch check (fewer than 32 running per instance cannot be helped there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import write_json

HERE = Path(__file__).resolve().parent
TRACES = Path(os.environ.get("SAMROLLOUT_TRACES", HERE.parent.parent / "shared" / "data" / "reasoning-traces"))
SKY = str(TRACES / "skyt1-ckpt-aime24.jsonl.gz")
R1 = str(TRACES / "r1distill-math-samples.jsonl.gz")
SEEDS = "0,1"
COMMON = ["--cost", str(HERE / "results" / "verify-cost-h100-k24.json"), "--kv-tokens", "350000", "--epochs", "2",
          "--checkpoint-gb", "16", "--drafter-time-scale", "0"]
PRIORS = ("table", "line", "wrong-table")
LIKE = ",".join(["off+length-aware", "suffix-best+length-aware", *(f"samrollout@{p}" for p in PRIORS)])
PRODUCT_PEERS = "off+fcfs,suffix+fcfs,samrollout"  # behind least-outstanding; ours there too (placement check)
SIZES = {  # trace, responses, groups per step, groups held async (>= 32 running per instance where the file allows)
    "sky-clean": ["--traces", SKY, "--responses", "clean", "--batch-groups", "4", "--max-concurrent-groups", "20"],
    "sky-all": ["--traces", SKY, "--responses", "all", "--batch-groups", "5", "--max-concurrent-groups", "12"],
    "r1": ["--traces", R1, "--responses", "all", "--batch-groups", "2", "--max-concurrent-groups", "4"],
}
# (name, kind, arguments): each a `samrollout simulate-rl` run, in order of importance.
RUNS: list[tuple[str, str, list[str]]] = [
    *((f"{t}-like", "like-for-like", [*SIZES[t], "--instances", "2", "--slots", "32", "--placements", "affine",
                                      "--loops", "sync,async", "--drafters", LIKE, "--seeds", SEEDS, "--train-ratio",
                                      "0"]) for t in ("sky-clean", "r1")),
    ("sky-clean-product-peers", "product", [*SIZES["sky-clean"], "--instances", "2,4", "--slots", "32",
                                            "--placements", "least-outstanding", "--loops", "async", "--drafters",
                                            PRODUCT_PEERS, "--seeds", SEEDS, "--train-ratio", "0"]),
    ("sky-clean-product-ours", "product", [*SIZES["sky-clean"], "--instances", "2,4", "--slots", "32",
                                           "--placements", "affine", "--loops", "async", "--drafters", "samrollout",
                                           "--seeds", SEEDS, "--train-ratio", "0"]),
    ("sky-clean-trainer-bound", "trainer-bound like-for-like", [
        *SIZES["sky-clean"], "--instances", "2", "--slots", "32", "--placements", "affine", "--loops", "sync,async",
        "--drafters", "off+length-aware,suffix-best+length-aware,samrollout@line", "--seeds", "0",
        "--train-ratio", "0.5"]),
    ("sky-all-like", "like-for-like", [*SIZES["sky-all"], "--instances", "2", "--slots", "32", "--placements",
                                       "affine", "--loops", "sync,async", "--drafters", LIKE, "--seeds", SEEDS,
                                       "--train-ratio", "0"]),  # the heaviest last: a cut-short run keeps the rest
]
LOOP_NAMES = ("sync", "async")
KEY_MODES = tuple(f"{loop}-{drafter}" for loop in LOOP_NAMES for drafter in ("off", "suffix", "samrollout"))


def run_one(name: str, arguments: list[str], tokenizer: str, jobs: int, work: Path, extra: list[str]
            ) -> list[dict[str, Any]]:
    """One `samrollout simulate-rl` run; its raw projections, each tagged with the run's name and command."""
    out = work / f"{name}.json"
    arguments = [*arguments, *extra]
    command = [sys.executable, "-m", "samrollout.cli", "simulate-rl", *arguments, *COMMON, "--tokenizer", tokenizer,
               "--jobs", str(jobs), "--json", str(out)]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - started
    report = json.loads(out.read_text())
    shown = " ".join(a if not a.startswith(str(TRACES)) else "$R/" + Path(a).name for a in [*arguments, *COMMON])
    return [{**p, "run": name, "command": f"samrollout simulate-rl {shown}", "run_wall_s": seconds}
            for p in report["projections"]]


def _entry(report: dict[str, Any]) -> dict[str, Any]:
    """One mode of a projection: the issue's figures first, the simulation's report beside them."""
    return {"samples_per_s": report["samples_per_s"], "tokens_per_s": report["tokens_per_s"],
            "mean_length": report["mean_length"], "steady": report["steady"],
            "step_cost_fit": report.get("step_cost_fit", {}), "report": report}


_COMMON_KEYS = ("run", "command", "traces", "responses", "instances", "slots", "train_ratio", "train_s",
                "train_reference", "drafter_time_scale", "placement", "batch_groups", "max_concurrent_groups",
                "staleness", "weights", "epochs", "prompts", "stream_groups", "seed")


def shaped(raw: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """A raw projection as the file's projections: like-for-like once per prior of ours (every drafter under
    length-aware admission and affine placement, `suffix` = suffix-best), or the product's parts."""
    modes = raw["modes"]
    common = {key: raw.get(key) for key in _COMMON_KEYS}
    common["steps"] = {loop: len(m["step_end_s"]) for loop in LOOP_NAMES for n, m in modes.items()
                       if n.startswith(loop + "-")}
    best = (raw.get("suffix_best") or {}).get("suffix-best+length-aware")
    if kind == "product":
        return [{**common, "scheduling": "product", "prior": "table", "admission": "ours length-aware, peers fcfs",
                 "modes": {name.split("+")[0]: _entry(m) for name, m in modes.items()}}]
    out = []
    for prior in PRIORS:
        ours = {n: m for n, m in modes.items() if n.endswith(f"-samrollout@{prior}")}
        if not ours:
            continue
        picked = {f"{loop}-off": modes[f"{loop}-off+length-aware"] for loop in LOOP_NAMES
                  if f"{loop}-off+length-aware" in modes}
        picked |= {f"{loop}-suffix": modes[f"{loop}-suffix-best+length-aware"] for loop in LOOP_NAMES
                   if f"{loop}-suffix-best+length-aware" in modes}
        picked |= {n.split("@")[0]: m for n, m in ours.items()}
        projection = {**common, "scheduling": kind, "admission": "length-aware", "prior": prior,
                      "suffix_best": best, "modes": {n: _entry(m) for n, m in picked.items()}}
        projection["ratios"] = ratios(projection)
        out.append(projection)
    return out


def ratios(projection: dict[str, Any]) -> dict[str, float | None]:
    """Ours against `suffix` (suffix-best) and against off, in steady tokens/s, per loop."""
    modes = projection["modes"]

    def rate(name: str) -> float | None:
        return modes[name]["steady"]["tokens_per_s"] if name in modes else None

    out: dict[str, float | None] = {}
    for loop in LOOP_NAMES:
        ours, suffix, off = rate(f"{loop}-samrollout"), rate(f"{loop}-suffix"), rate(f"{loop}-off")
        out[f"{loop}_ours_vs_suffix"] = ours / suffix if ours and suffix else None
        out[f"{loop}_ours_vs_off"] = ours / off if ours and off else None
    return out


def summary(projections: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures: per run and prior, ours against suffix-best (mean, min, max over seeds); each prior
    against the table; the product at 2 and 4 instances."""
    out: dict[str, Any] = {"like_for_like": {}, "product": {}}
    for p in projections:
        if p["scheduling"] == "product":
            continue
        key = f"{p['run']} prior={p['prior']}"
        cell = out["like_for_like"].setdefault(key, {"seeds": {}, "suffix_best": {}})
        cell["seeds"][str(p["seed"])] = {r: v for r, v in p["ratios"].items()}
        cell["suffix_best"][str(p["seed"])] = (p.get("suffix_best") or {}).get("mode")
        cell["steady_tokens_per_s"] = cell.get("steady_tokens_per_s", {})
        cell["steady_tokens_per_s"][str(p["seed"])] = {m: e["steady"]["tokens_per_s"] for m, e in p["modes"].items()}
    for cell in out["like_for_like"].values():
        for ratio in ("sync_ours_vs_suffix", "async_ours_vs_suffix", "async_ours_vs_off"):
            values = [s[ratio] for s in cell["seeds"].values() if s.get(ratio)]
            if values:
                cell[ratio] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    for key, cell in out["like_for_like"].items():
        table = out["like_for_like"].get(key.replace(key.split("prior=")[1], "table"))
        if table and "prior=table" not in key:
            cell["vs_table"] = {seed: {m: rates[m] / table["steady_tokens_per_s"][seed][m]
                                       for m in rates if m.endswith("samrollout")}
                                for seed, rates in cell["steady_tokens_per_s"].items()
                                if seed in table["steady_tokens_per_s"]}
    rates: dict[tuple[int, str], dict[str, float]] = {}
    for p in projections:
        if p["scheduling"] == "product":
            for name, e in p["modes"].items():
                label = f"{name}-{p['placement']}"
                rates.setdefault((p["instances"], str(p["seed"])), {})[label] = e["steady"]["tokens_per_s"]
    for (instances, seed), r in sorted(rates.items()):
        ours = r.get("async-samrollout-affine")
        out["product"][f"{instances} instances seed {seed}"] = {
            **r, "ours_vs_suffix": ours / r["async-suffix-least-outstanding"]
            if ours and r.get("async-suffix-least-outstanding") else None,
            "ours_vs_off": ours / r["async-off-least-outstanding"]
            if ours and r.get("async-off-least-outstanding") else None}
    return out


def print_table(projections: list[dict[str, Any]]) -> None:
    """One line per projection: steady tokens/s per key mode and ours against the peers."""
    print(f"\n{'run':<26}{'seed':>5}{'prior':>12}{'train':>6}{'inst':>5}{'placement':>19}"
          + "".join(f"{m:>16}" for m in KEY_MODES) + f"{'a ours/suf':>11}{'s ours/suf':>11}  suffix-best")
    for p in projections:
        r = p.get("ratios") or {}
        cells = "".join(f"{p['modes'][m]['steady']['tokens_per_s']:>16.1f}" if m in p["modes"] else f"{'-':>16}"
                        for m in KEY_MODES)
        best = (p.get("suffix_best") or {}).get("mode", "")
        print(f"{p['run']:<26}{p['seed']!s:>5}{p['prior']:>12}{p['train_ratio']!s:>6}{p['instances']:>5}"
              f"{p['placement']:>19}{cells}{r.get('async_ours_vs_suffix') or 0:>11.3f}"
              f"{r.get('sync_ours_vs_suffix') or 0:>11.3f}  {best}")
    for label, values in (p for p in summary(projections)["product"].items()):
        print(f"product {label}: ours/suffix {values['ours_vs_suffix'] or 0:.3f}, "
              f"ours/off {values['ours_vs_off'] or 0:.3f}")


def plot(projections: list[dict[str, Any]], path: Path) -> None:
    """Steady tokens/s of the key modes, one panel per run (training free, like-for-like length-aware, drafter
    time at the reference host's speed and at 0)."""
    from plotting import save, subplots

    shown = [p for p in projections if p["scheduling"] == "like-for-like" and p["prior"] == "line"]
    fig, axes = subplots(1, max(1, len(shown)), figsize=(3.4 * max(1, len(shown)), 3.9), squeeze=False)
    for ax, p in zip(axes.flat, shown, strict=False):
        rates = [p["modes"][m]["steady"]["tokens_per_s"] for m in KEY_MODES]
        ax.bar(range(len(KEY_MODES)), rates, color=["#999999", "#cc7744", "#3377bb"] * 2)
        ax.set_xticks(range(len(KEY_MODES)), [m.replace("samrollout", "ours") for m in KEY_MODES], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(f"{p['run']} seed {p['seed']}, ours on the line prior", fontsize=8)
    axes.flat[0].set_ylabel("steady tokens / s to the trainer (projected, H100)")
    save(fig, path)


def main() -> None:
    """Run every projection, shape, print, write (the JSON after each run: a cut-short run keeps what ran)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(name for name, _, _ in RUNS), help="which of RUNS")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tokenizer", help="default: the built-in model's (`samrollout model smollm2`)")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "projected-rl-h100.json")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--extra", default="", help="arguments added to every run (a smoke run: '--max-groups 4')")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from provenance import builtin_tokenizer, command_line, git_commit

    args.tokenizer = builtin_tokenizer(args.tokenizer)
    commit = git_commit()
    wanted = set(args.runs.split(","))
    projections: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        for name, kind, arguments in RUNS:
            if name in wanted:
                for raw in run_one(name, arguments, args.tokenizer, args.jobs, Path(work), args.extra.split()):
                    projections += shaped(raw, kind)
                write_json(args.json, {"commit": commit, "command": command_line("project_rl.py"),
                                       "runs_done": sorted({p["run"] for p in projections}),
                                       "wall_s": time.perf_counter() - started, "summary": summary(projections),
                                       "projections": projections}, indent=1)
    print_table(projections)
    print(json.dumps(summary(projections), indent=1, default=str)[:6000])
    if args.plot:
        plot(projections, args.plot)


if __name__ == "__main__":
    main()
