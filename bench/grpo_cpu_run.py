"""The CPU GRPO example run for real, sync against async on the same servers, with a Prometheus watching.

    python bench/grpo_cpu_run.py --modes sync,async --steps 30 --json bench/results/grpo-cpu.json \\
        --plots bench/results --traces bench/data/smollm2-grpo-epochs.jsonl.gz --panels deploy/samrollout-panels.png

Starts ``--servers`` `samrollout serve` processes of the built-in model (each other's
``--weight-peers`` when two: the pushes are relayed) at their defaults, and a Prometheus scraping
them with the deployment's rules; then runs ``examples/grpo_cpu.py`` once per mode, each from the
built-in weights (pushed back to the servers before a mode that follows another). It writes, per
mode, the example's summary (samples/s, reward per minute, reward first and last 5 steps, tokens
with a wrong version) and what the servers' drafters did (drafted and accepted tokens), the
plots ``grpo-cpu-<mode>.png``, the traces of the mode named by ``--trace-mode`` and the dashboard's
panels drawn from Prometheus at the last mode's second-to-last step (while it still generates).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from harness import write_json
from provenance import ROOT, command_line, git_commit

sys.path.insert(0, str(ROOT / "examples"))


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--servers", type=int, default=1, choices=[1, 2])
    p.add_argument("--example-args", default="", help="more arguments for examples/grpo_cpu.py, one string")
    p.add_argument("--json", type=Path, default=Path("bench/results/grpo-cpu.json"))
    p.add_argument("--plots", type=Path, default=Path("bench/results"), help="folder for grpo-cpu-<mode>.png")
    p.add_argument("--traces", type=Path, help="copy this mode's rollouts here (see --trace-mode)")
    p.add_argument("--trace-mode", default="sync")
    p.add_argument("--panels", type=Path, help="draw the dashboard's panels here (during the last mode)")
    p.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="samrollout-grpo-")))
    return p.parse_args()


def start_servers(count: int, api_key: str, work: Path) -> list[Any]:
    """``count`` servers of the built-in model at their defaults; two name each other as weight peers."""
    from samrollout.testing import launch_peered_servers

    launched = launch_peered_servers(count, ["--api-key", api_key, "--log-level", "warning"],
                                     [work / f"server-{index}.log" for index in range(count)])
    return [server.ready() for server in launched]


def drafter_counts(urls: list[str], api_key: str) -> dict[str, int]:
    """The servers' drafter counters, summed: steps, draft tokens, accepted tokens."""
    totals = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for url in urls:
        status = httpx.get(f"{url}/admin/status", headers={"Authorization": f"Bearer {api_key}"}, timeout=60).json()
        for key in totals:
            totals[key] += int(status["drafter"][key])
    return totals


async def reset_weights(urls: list[str], api_key: str, model_dir: Path, version: str) -> None:
    """Every server back on the built-in weights, as ``version``."""
    from samrollout_client import AsyncRolloutClient

    async with AsyncRolloutClient(urls, model="smollm2-135m-instruct", api_key=api_key) as client:
        await client.push_weights(model_dir, version=version)


def run_mode(mode: str, args: argparse.Namespace, urls: list[str], api_key: str) -> dict[str, Any]:
    """One run of the example in ``mode``; its summary and the drafters' work during it."""
    import grpo_cpu

    before = drafter_counts(urls, api_key)
    argv = [arg for url in urls for arg in ("--url", url)] + [
        "--api-key", api_key, "--mode", mode, "--steps", str(args.steps), "--out", str(args.work / mode),
        *args.example_args.split()]
    summary: dict[str, Any] = grpo_cpu.main(argv)
    after = drafter_counts(urls, api_key)
    drafted = {key: after[key] - before[key] for key in after}
    drafted["acceptance_rate"] = drafted["accepted_tokens"] / max(drafted["draft_tokens"], 1)
    summary["drafter"] = drafted
    return summary


def draw_panels(prometheus_url: str, summary: dict[str, Any], out: Path) -> None:
    """The dashboard's panels over ``summary``'s run, their stats 2 s after its second-to-last push (the next
    step's groups generating)."""
    steps = summary["steps"]
    end = (steps[-2]["finished_at"] if len(steps) > 1 else steps[-1]["finished_at"]) + 2.0
    minutes = (end - summary["started_at"]) / 60 + 0.5
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "deploy" / "render_panels.py"), "--prometheus", prometheus_url,
                    "--minutes", f"{minutes:.1f}", "--end", f"{end:.1f}", "--scrape-interval", "1",
                    "--out", str(out)], check=True)


def main() -> None:
    """Start the servers and Prometheus, run each mode, write the JSON, plots, traces and panels."""
    from samrollout.models import ensure_smollm2
    from samrollout.testing import start_prometheus

    args, commit, api_key = parse_args(), git_commit(), secrets.token_hex(8)
    model_dir = ensure_smollm2()
    servers = start_servers(args.servers, api_key, args.work)
    urls = [server.url for server in servers]
    prometheus = start_prometheus([urlsplit(url).netloc for url in urls], args.work / "prometheus",
                                  ROOT / "deploy" / "prometheus" / "rules.yml")
    results: dict[str, Any] = {}
    try:
        for index, mode in enumerate(args.modes.split(",")):
            if index:
                asyncio.run(reset_weights(urls, api_key, model_dir, f"{mode}-initial"))
            results[mode] = run_mode(mode, args, urls, api_key)
            shutil.copy(args.work / mode / "grpo.png", args.plots / f"grpo-cpu-{mode}.png")
        if args.panels:
            draw_panels(prometheus.url, results[mode], args.panels)
    finally:
        for process in [*servers, prometheus]:
            process.stop()
    if args.traces:
        shutil.copy(args.work / args.trace_mode / "rollouts.jsonl.gz", args.traces)
    write_results(args, commit, results)


def write_results(args: argparse.Namespace, commit: str, results: dict[str, Any]) -> None:
    """Print the side-by-side table and write the JSON."""
    print(f"{'mode':6s} {'wall s':>7s} {'samples/s':>9s} {'reward/min':>10s} {'first5':>7s} {'last5':>7s} "
          f"{'+-se':>6s} {'wrong-version':>13s} {'accept':>7s}")
    for mode, summary in results.items():
        print(f"{mode:6s} {summary['wall_s']:7.0f} {summary['samples_per_s']:9.2f} "
              f"{summary['reward_per_minute']:10.1f} {summary['first5_mean_reward']:7.3f} "
              f"{summary['last5_mean_reward']:7.3f} {summary['reward_gain_se']:6.3f} "
              f"{summary['wrong_version_tokens']:13d} {summary['drafter']['acceptance_rate']:7.2f}")
    payload = {"command": command_line("grpo_cpu_run.py"), "commit": commit,
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "servers": args.servers, "modes": results}
    write_json(args.json, payload, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
