"""Write `bench/results/README.md`: every result file with the commit that last wrote it and the command it
records, the current ones (what the docs' claims rest on) first.

    python bench/results_index.py

Result files are never edited by hand, so the commit that last changed a file is the code that produced it
(give or take uncommitted changes of the day, which the file's own ``commit`` field, where it has one, names).
"""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# The files the docs' current claims rest on, and what each shows.
CURRENT = {
    "cpu-engine-vs-peers.json": "the CPU engine: the default against no speculation, vLLM `suffix` and the static "
                                "mode, greedy and sampled (docs/tuning.md)",
    "projected-h100.json": "one synchronous step on the H100 table, every drafter, charged at 0 and at the reference "
                           "host's speed (docs/simulator.md)",
    "projected-rl-h100.json": "RL loops at scale on the H100 table, like for like and as products "
                              "(docs/simulator-rl.md)",
    "host-speed.json": "this host's single-thread speed against the reference host (bench/host_speed.py)",
    "verify-cost-h100-k24.json": "the H100 cost table the projections and the CUDA cost prior use",
    "verify-cost-h100.json": "the H100 cost table up to k = 16",
    "engine-cost-cpu.json": "the CPU engine's cost table (the simulator's calibration)",
    "simulator-calibration-cpu.json": "the rollout simulator against the CPU engine, the static mode's modes (not run "
                                      "again with the adaptive policy; docs/simulator.md)",
    "simulator-rl-calibration-cpu.json": "the RL-loop simulator against real servers, the static mode (not run again "
                                         "with the adaptive policy; docs/simulator-rl.md)",
    "weight-push-fanout-cpu.json": "a relayed weight push to 1 and 4 servers (docs/rl-controls.md)",
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE.parent).stdout.strip()


def _recorded(path: Path) -> dict[str, Any]:
    """The command and commit a JSON result records about itself, if any."""
    if path.suffix not in (".json", ".gz"):
        return {}
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {"command": data.get("command"), "commit": data.get("commit")}


def row(path: Path) -> str:
    """One table row: the file, the commit that last changed it (and its date), the command it records."""
    last = _git("log", "-1", "--format=%h %as", "--", str(path.relative_to(HERE.parent))) or "uncommitted"
    recorded = _recorded(path)
    command = f"`{recorded['command']}`" if recorded.get("command") else "-"
    commit = recorded.get("commit") or last.split(" ")[0]
    date = last.split(" ")[1] if " " in last else "-"
    name = path.relative_to(RESULTS)
    return f"| `{name}` | {commit[:12]} | {date} | {command} |"


def main() -> None:
    """Write the index."""
    files = sorted(p for p in RESULTS.iterdir() if p.name not in ("README.md", "archive"))
    archived = sorted((RESULTS / "archive").iterdir()) if (RESULTS / "archive").is_dir() else []
    lines = ["# Benchmark results", "",
             "Written by `python bench/results_index.py`. Each file comes from a `bench/` script; the commit is the "
             "one the file records, else the last commit that changed it. Figures are only comparable within one "
             "file (one run, one machine, one day): the docs quote each with its file.", "",
             "## Current", "", "| file | what it shows |", "| --- | --- |"]
    lines += [f"| `{name}` | {what} |" for name, what in CURRENT.items() if (RESULTS / name).exists()]
    header = ["| file | commit | date | command |", "| --- | --- | --- | --- |"]
    lines += ["", "## Every file here", "", *header, *(row(p) for p in files)]
    lines += ["", "## Archive", "",
              "`archive/`: earlier measurements that the current code no longer reproduces (older defaults, older "
              "simulator versions), kept as the record the docs' history sections cite.", "", *header,
              *(row(p) for p in archived)]
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")
    print(f"indexed {len(files)} files and {len(archived)} archived")


if __name__ == "__main__":
    main()
