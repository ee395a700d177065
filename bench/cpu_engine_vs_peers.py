"""The CPU engine, the one engine measured here: samrollout's default against no speculation, vLLM `suffix` (at
vLLM's default k and at its best k) and its previous defaults, greedy in the engine and sampled through the server,
interleaved rounds, one run.

    python bench/cpu_engine_vs_peers.py --rounds 3 --json bench/results/cpu-engine-vs-peers.json \\
        --plot bench/results/cpu-engine-vs-peers.png

- **greedy**: `bench/spec_engine.py`'s heavy-tailed greedy rollout (32 requests, 8 prompts with group ids, max_tokens
  Pareto-distributed up to 768, ignore_eos), each mode in its own process: ``off``, vLLM ``suffix`` at vLLM's
  default k (``suffix-default``: num_speculative_tokens unset, so vLLM's tree depth, 24) and at k 3 and 8
  (``suffix-k3``, ``suffix-k8``; ``suffix-best`` is the fastest of k {3, 8, 24}, its k recorded), ``previous``
  (`sam-static`: the static threshold with confident drafts, the CPU defaults before the
  adaptive policy) and ``default`` (`sam-default`: the server's defaults now).
- **sampled**: a GRPO-shaped rollout through a real server, temperature 1 and unseeded as RL samples: 8 math
  prompts of the bundled traces, each one chat request with n = 8 (a group: its siblings draft from each other),
  max_tokens per prompt from 48 to 640 (heavy-tailed), ignore_eos; the makespan is from sending every request to
  the last reply.  ``off`` (`samrollout serve --no-speculation`), ``previous`` (`--threshold-mode static`),
  ``default`` (`samrollout serve`) and ``suffix-default``, ``suffix-k3``, ``suffix-k8`` (plain `vllm serve` with
  SuffixDecoding at k 24 = vLLM's default, 3, 8, and samrollout's CPU sampled-verification plugin alone, so that
  its sampled drafts are verified exactly as ours are); ``suffix-best`` as in greedy.

Rounds are interleaved (every mode once per round, in the same order), so slow drift of the machine hits every
mode alike; the JSON keeps each round's figures beside the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import write_json

HERE = Path(__file__).resolve().parent
GREEDY_MODES = {"off": "off", "suffix-default": "suffix-default", "suffix-k3": "suffix-k3", "suffix-k8": "suffix-k8",
                "previous": "sam-static", "default": "sam-default"}
SAMPLED_MODES = ("off", "previous", "default", "suffix-default", "suffix-k3", "suffix-k8")
SUFFIX_KS = {"suffix-k3": 3, "suffix-k8": 8, "suffix-default": 24}  # suffix-best: the fastest of these
VLLM_SUFFIX_DEFAULT_K = 24  # vLLM 0.32: num_speculative_tokens defaults to suffix_decoding_max_tree_depth (24)
MAX_TOKENS = (48, 64, 80, 112, 160, 240, 384, 640)  # per prompt: most short, a few long
SERVED_NAME = "bench"


def greedy(rounds: int, work: Path, measured: Path | None = None) -> dict[str, Any]:
    """`bench/spec_engine.py`'s greedy rollout, every mode in its own process, ``rounds`` interleaved rounds (or
    the figures of an earlier run of it, ``measured``: its JSON)."""
    out = measured or work / "greedy.json"
    if measured is None:
        command = [sys.executable, str(HERE / "spec_engine.py"), "--modes", ",".join(GREEDY_MODES.values()),
                   "--batch-sizes", "", "--repeats", str(rounds), "--json", str(out)]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    figures: dict[str, Any] = {}
    for name, mode in GREEDY_MODES.items():
        runs = [run["rollout"] for run in results[mode]["runs"]]
        figures[name] = {"makespan_s": statistics.median(r["makespan_s"] for r in runs),
                         "steps": statistics.median(r["steps"] for r in runs),
                         "mean_acceptance_length": statistics.median(r["mean_acceptance_length"] for r in runs),
                         "rounds": [{key: r[key] for key in ("makespan_s", "tail_s", "steps", "tail_steps",
                                                             "mean_acceptance_length")} for r in runs]}
    return figures


def prompts() -> list[str]:
    """The first 8 prompts of the bundled math traces (questions SmolLM2 answers at length)."""
    seen: list[str] = []
    with gzip.open(HERE / "data" / "smollm2-math-groups.jsonl.gz", "rt") as handle:
        for line in handle:
            prompt = json.loads(line)["prompt"]
            if prompt not in seen:
                seen.append(prompt)
            if len(seen) == len(MAX_TOKENS):
                break
    return seen


async def rollout(url: str, questions: list[str], n: int) -> dict[str, Any]:
    """One sampled GRPO-shaped rollout: every prompt's group at once; its makespan and tokens."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=1800.0, trust_env=False) as client:
        async def group(question: str, max_tokens: int) -> int:
            reply = await client.post("/v1/chat/completions", json={
                "model": SERVED_NAME, "messages": [{"role": "user", "content": question}], "n": n,
                "temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True})
            reply.raise_for_status()
            tokens: int = reply.json()["usage"]["completion_tokens"]
            return tokens

        started = time.perf_counter()
        tokens = await asyncio.gather(*(group(q, m) for q, m in zip(questions, MAX_TOKENS, strict=False)))
        return {"makespan_s": time.perf_counter() - started, "tokens": sum(tokens)}


def server_command(mode: str, model: str) -> tuple[Callable[[int], list[str]], dict[str, str]]:
    """The server a sampled mode runs: ours with its flags, or plain `vllm serve` with SuffixDecoding."""
    common = ["--model", model, "--served-model-name", SERVED_NAME, "--max-model-len", "4096"]
    if not mode.startswith("suffix"):
        flags = {"off": ["--no-speculation"], "previous": ["--threshold-mode", "static"], "default": []}[mode]
        return (lambda port: [sys.executable, "-m", "samrollout.cli", "serve", *common, "--port", str(port),
                              "--log-level", "warning", *flags]), {}
    sys.path.insert(0, str(HERE))
    from http_overhead import vllm_serve_command

    plain, env = vllm_serve_command(model, argparse.Namespace(max_model_len=4096, served_name=SERVED_NAME))
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": SUFFIX_KS[mode]})
    # Only samrollout's sampled-verification plugin: vLLM's CPU backend then verifies sampled drafts exactly.
    env["VLLM_PLUGINS"] = "samrollout_cpu_sampled_verification"
    return (lambda port: [*plain(port), "--speculative-config", spec]), env


def sampled(rounds: int, n: int, work: Path) -> dict[str, Any]:
    """The sampled rollout through each mode's server, ``rounds`` interleaved rounds (a server per mode and round)."""
    from samrollout.models import ensure_smollm2
    from samrollout.testing import start_command

    model = str(ensure_smollm2())
    questions = prompts()
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in SAMPLED_MODES}
    for round_index in range(rounds):
        for mode in SAMPLED_MODES:
            command, env = server_command(mode, model)
            server = start_command(command, work / f"{mode}-{round_index}.log", env)
            try:
                asyncio.run(rollout(server.url, questions[:2], 2))  # warm-up: the two shortest groups
                runs[mode].append(asyncio.run(rollout(server.url, questions, n)))
            finally:
                server.stop()
            print(f"sampled round {round_index + 1}/{rounds} {mode}: {runs[mode][-1]}", flush=True)
    return {mode: {"makespan_s": statistics.median(r["makespan_s"] for r in mode_runs), "rounds": mode_runs}
            for mode, mode_runs in runs.items()}


def add_suffix_best(figures: dict[str, Any]) -> None:
    """``suffix-best``: the fastest (median makespan) of `suffix` at the k's of `SUFFIX_KS`, with its k; and each
    suffix mode's k recorded."""
    ran = {mode: k for mode, k in SUFFIX_KS.items() if mode in figures}
    for mode, k in ran.items():
        figures[mode]["k"] = k
    if ran:
        winner = min(ran, key=lambda m: figures[m]["makespan_s"])
        figures["suffix-best"] = {**figures[winner], "k": ran[winner], "of": {m: ran[m] for m in ran}}


def plot(result: dict[str, Any], path: Path) -> None:
    """Makespans of both rollouts per mode, each round a dot and the median a bar."""
    from plotting import save, subplots

    fig, axes = subplots(1, 2, figsize=(9, 3.6))
    for ax, kind in zip(axes, ("greedy", "sampled"), strict=True):
        modes = list(result[kind])
        medians = [result[kind][m]["makespan_s"] for m in modes]
        ax.bar(modes, medians, color=["#999999", "#cc7744", "#cc7744", "#cc7744", "#88aadd", "#3377bb", "#cc7744",
                                      "#cc7744"][:len(modes)])
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        for i, m in enumerate(modes):
            ax.plot([i] * len(result[kind][m]["rounds"]), [r["makespan_s"] for r in result[kind][m]["rounds"]],
                    "k.", ms=4)
        ax.set_title(f"{kind} rollout, CPU engine (median of {len(result[kind][modes[0]]['rounds'])} rounds)",
                     fontsize=9)
        ax.set_ylabel("makespan s")
    save(fig, path)


def main() -> None:
    """Both rollouts, then print, write and plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt in the sampled rollout")
    parser.add_argument("--only", choices=("greedy", "sampled"))
    parser.add_argument("--greedy-from", type=Path, help="the JSON of an earlier greedy run (bench/spec_engine.py "
                        "with these modes) to report instead of running it again")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from provenance import command_line, git_commit

    work = Path("/tmp/samrollout-cpu-engine-vs-peers")
    work.mkdir(exist_ok=True)
    result: dict[str, Any] = {"commit": git_commit(), "command": command_line("cpu_engine_vs_peers.py")}
    if args.only != "sampled":
        result["greedy"] = greedy(args.rounds, work, args.greedy_from)
        if args.greedy_from:
            result["greedy_from"] = json.loads(args.greedy_from.read_text())["args"]
    if args.only != "greedy":
        result["sampled"] = sampled(args.rounds, args.n, work)
    for kind in ("greedy", "sampled"):
        if kind in result:
            add_suffix_best(result[kind])
            off = result[kind]["off"]["makespan_s"]
            for mode, figures in result[kind].items():
                against = {f"x_{peer}": figures["makespan_s"] / result[kind][peer]["makespan_s"]
                           for peer in ("off", "suffix-default", "suffix-best", "previous") if peer in result[kind]}
                figures.update(against)
                print(f"{kind:<8}{mode:<16}{figures['makespan_s']:>8.2f} s  x off {figures['makespan_s'] / off:.3f}  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in against.items()))
    if args.json:
        write_json(args.json, result, indent=1)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
