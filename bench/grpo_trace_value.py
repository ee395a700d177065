"""What the CPU GRPO run's traces say: cross-epoch history as the policy really drifts, acceptance over training,
and history-affine against least-outstanding placement.

    python bench/grpo_trace_value.py --traces bench/data/smollm2-grpo-epochs.jsonl.gz \\
        --json bench/results/grpo-trace-value.json --plot bench/results/grpo-trace-value.png

The traces are on-policy rollouts of one prompt set from one policy as it trains
(`examples/grpo_cpu.py`, ``meta.epoch`` on every line). For every epoch e >= 1 it runs, on that
epoch's responses alone:

- ``samrollout replay`` with the earlier epochs as history (``--history``), every step drafting
  (``--threshold off``, as a rollout's tail does): MAL of our drafters without history (``sam``:
  own; ``sam-group``: own + siblings) and with it (``sam-history``), and of vLLM's ``suffix``
  without and with its global cache (``suffix-cache``), each at its engine's k and all at k = 8;
- ``samrollout simulate`` of that epoch's step (H100 table, 64 slots, one instance), once with
  the earlier epochs as history and once without them: the projected makespan per mode.

Then ``samrollout simulate-rl`` over all epochs at 2 instances, affine against least-outstanding
placement (the checkpoint pushed each step is the real one's size, ``--checkpoint-gb``).
Each figure for all responses and for the clean ones (finished on their own).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from harness import write_json
from provenance import ROOT, command_line, git_commit

COST = ROOT / "service" / "samrollout" / "cost_tables" / "h100-qwen3-8b.json"
REPLAY_DRAFTERS = "sam,sam-group,sam-history,suffix,suffix-cache"
SIM_MODES = "off,suffix,samrollout"
EQUAL_K = 8  # every drafter at one k as well: the engines' own k differ (ours 3 in replay, suffix 24)


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=Path, default=ROOT / "bench" / "data" / "smollm2-grpo-epochs.jsonl.gz")
    p.add_argument("--checkpoint-gb", type=float, default=0.27, help="the checkpoint each step pushes (simulate-rl)")
    p.add_argument("--json", type=Path, default=Path("bench/results/grpo-trace-value.json"))
    p.add_argument("--plot", type=Path)
    return p.parse_args()


def epochs_of(path: Path) -> dict[int, list[dict[str, Any]]]:
    """The trace's lines by epoch, keeping only epochs in which every prompt of the file has a group."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle]
    by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        by_epoch[int(line["meta"]["epoch"])].append(line)
    prompts = {line["prompt_id"] for line in lines}
    return {e: group for e, group in sorted(by_epoch.items()) if {line["prompt_id"] for line in group} == prompts}


def write(lines: list[dict[str, Any]], path: Path) -> Path:
    """``lines`` as a trace file."""
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(line) + "\n" for line in lines)
    return path


def samrollout(*args: str) -> dict[str, Any]:
    """Run ``samrollout ARGS --json <tmp>``; its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(["samrollout", *args, "--json", out.name], check=True, capture_output=True)
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def replay_epoch(with_history: Path, history: int, k: int | None = None) -> dict[str, dict[str, float]]:
    """MAL per drafter (all and clean responses) of the epoch after ``history`` earlier responses per prompt; each
    drafter at its engine's k, or all at ``k``."""
    result = samrollout("replay", "--traces", str(with_history), "--history", str(history), "--threshold", "off",
                        "--responses", "both", "--drafters", REPLAY_DRAFTERS, "--oracle-sources", "",
                        "--long-context", "", *(["--k", str(k)] if k else []))
    return {run["responses"]: {row["drafter"]: row["mean_acceptance_length"] for row in run["drafters"]}
            for run in result["runs"]}


def simulate_epoch(trace: Path, history: int) -> dict[str, dict[str, float]]:
    """Projected makespan (s) per mode of one epoch's step, H100 table, 64 slots, ``history`` earlier responses."""
    result = samrollout("simulate", "--traces", str(trace), "--cost", str(COST), "--history", str(history),
                        "--modes", SIM_MODES, "--slots", "64", "--responses", "both")
    return {p["responses"]: {mode: v["makespan_s"] for mode, v in p["modes"].items()} for p in result["projections"]}


def per_epoch(epochs: dict[int, list[dict[str, Any]]], work: Path) -> list[dict[str, Any]]:
    """Replay and simulate every epoch after the first, with and without the earlier epochs as history."""
    rows = []
    ordered = sorted(epochs)
    for e in ordered[1:]:
        # The history is every earlier response, clean or not (as a server's is): marked clean here so that
        # --responses clean, which filters before --history counts, still finds 8 per prompt per epoch.
        earlier = [{**line, "meta": {**line["meta"], "finished": True}} for k in ordered if k < e for line in epochs[k]]
        history = len(earlier) // len({line["prompt_id"] for line in epochs[e]})
        both = write(earlier + epochs[e], work / f"epochs-to-{e}.jsonl.gz")
        alone = write(epochs[e], work / f"epoch-{e}.jsonl.gz")
        rewards = [line["meta"]["reward"] for line in epochs[e]]
        rows.append({"epoch": e, "history_responses_per_prompt": history,
                     "mean_reward": sum(rewards) / len(rewards),
                     "mean_length": sum(len(line["response_ids"]) for line in epochs[e]) / len(epochs[e]),
                     "mal": replay_epoch(both, history), f"mal_k{EQUAL_K}": replay_epoch(both, history, EQUAL_K),
                     "makespan_with_history": simulate_epoch(both, history),
                     "makespan_without_history": simulate_epoch(alone, 0)})
        row = rows[-1]
        print(f"epoch {e}: reward {row['mean_reward']:.3f}; MAL (all) "
              + ", ".join(f"{k} {v:.3f}" for k, v in row["mal"]["all"].items())
              + f"; at k={EQUAL_K}: " + ", ".join(f"{k} {v:.3f}" for k, v in row[f"mal_k{EQUAL_K}"]["all"].items())
              + "; makespan (all) with / without history: " + ", ".join(
                  f"{mode} {row['makespan_with_history']['all'][mode]:.3f} / "
                  f"{row['makespan_without_history']['all'][mode]:.3f} s" for mode in SIM_MODES.split(",")),
              flush=True)
    return rows


def placement(trace: Path, epochs: int, checkpoint_gb: float) -> dict[str, Any]:
    """simulate-rl at 2 instances: steady tokens/s, history hit rate and MAL per placement, loop and drafter."""
    result = samrollout("simulate-rl", "--traces", str(trace), "--cost", str(COST), "--epochs", str(epochs),
                        "--instances", "2", "--placements", "affine,least-outstanding", "--drafters", SIM_MODES,
                        "--responses", "both", "--checkpoint-gb", str(checkpoint_gb), "--weights", "push")
    table: dict[str, Any] = {}
    for p in result["projections"]:
        for mode, v in p["modes"].items():
            table.setdefault(p["responses"], {}).setdefault(mode, {})[p["placement"]] = {
                "steady_tokens_per_s": v["steady"]["tokens_per_s"], "history_hit": v.get("history_hit_rate"),
                "mal": v.get("mean_acceptance_length")}
    return table


def main() -> None:
    """Measure, print, write the JSON (and the plot)."""
    args, commit = parse_args(), git_commit()
    epochs = epochs_of(args.traces)
    with tempfile.TemporaryDirectory() as work:
        rows = per_epoch(epochs, Path(work))
        only_full = write([line for e in sorted(epochs) for line in epochs[e]], Path(work) / "full.jsonl.gz")
        placed = placement(only_full, len(epochs), args.checkpoint_gb)
    for responses, modes in placed.items():
        for mode, by_placement in modes.items():
            print(f"simulate-rl {responses:5s} {mode:24s} " + "  ".join(
                f"{name}: {v['steady_tokens_per_s']:.1f} tok/s, hit {v['history_hit']}" for name, v in
                by_placement.items()))
    payload = {"command": command_line("grpo_trace_value.py"), "commit": commit,
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "traces": str(args.traces),
               "epochs": sorted(epochs), "per_epoch": rows, "placement_2_instances": placed}
    write_json(args.json, payload, indent=1)
    if args.plot:
        plot(rows, args.plot)
    print(f"wrote {args.json}")


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    """MAL per epoch by drafter (all responses, every drafter at k = EQUAL_K), beside the epoch's mean reward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [row["epoch"] for row in rows]
    for drafter in REPLAY_DRAFTERS.split(","):
        ax.plot(x, [row[f"mal_k{EQUAL_K}"]["all"][drafter] for row in rows], marker="o", label=drafter)
    ax.set(xlabel="epoch", ylabel=f"MAL (every step drafts, k = {EQUAL_K})", title="Acceptance as the policy trains")
    twin = ax.twinx()
    twin.plot(x, [row["mean_reward"] for row in rows], color="grey", linestyle="--", label="mean reward")
    twin.set_ylabel("mean reward")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
