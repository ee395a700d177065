"""AReaL's own vLLM engine against samrollout's (`samrollout_client.areal.SamrolloutEngine`) on the same servers.

    python bench/areal_engines.py --servers 2 --prompts 8 --n 4 --epochs 3 --json bench/results/areal-engines-cpu.json

Both engines run AReaL 1.0's real rollout code (`RemoteInfEngine`, its workflow executor,
`RLVRWorkflow`) against ``--servers`` samrollout servers (built-in SmolLM2-135M, SAM on,
``--areal-routes``).  Each engine rolls out its own ``--prompts`` arithmetic questions (the two
sets are disjoint, so neither draws on history the other built) ``--epochs`` times, the way
GRPO revisits a dataset, each prompt as a group of ``--n`` sampled responses; the engines
alternate epoch by epoch.  AReaL's engine sends a group's responses round-robin over the
servers; samrollout's keeps them on one server (one group automaton) and sends a prompt back to
the same server every epoch (its cross-epoch history).  Reported per epoch and engine: wall
time, responses per second, and the servers' drafting: the share of output tokens that came
from accepted drafts and the tokens per verification.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness import host, interleaved, launch_servers, serving, write_json

ENGINES = ("areal", "samrollout")
COUNTERS = {"generated": "vllm:generation_tokens_total", "accepted": "samrollout_spec_decode_accepted_tokens_total",
            "drafts": "samrollout_spec_decode_drafts_total"}


def questions(seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` arithmetic questions as AReaL chat data (a seed per engine: disjoint sets)."""
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": f"What is {rng.randint(100, 999)} * {rng.randint(10, 99)}? "
                                                      "Work it out step by step."}]} for _ in range(count)]


def zero_reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **_: Any) -> float:
    """The bench scores nothing (AReaL computes rewards in a process pool: module level)."""
    return 0.0


def counters(urls: list[str]) -> dict[str, float]:
    """The drafting counters summed over the servers."""
    import httpx

    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
            for key, name in COUNTERS.items():
                if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                    totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def epoch(engine: Any, data: list[dict[str, Any]], workflow: Any, n: int, urls: list[str]) -> dict[str, Any]:
    """One rollout of every prompt as a group of ``n``; what it took and what the drafter did."""
    before = counters(urls)
    started = time.perf_counter()
    batch = engine.rollout_batch(data, workflow=workflow, group_size=n)
    seconds = time.perf_counter() - started
    after = counters(urls)
    delta = {key: after[key] - before[key] for key in COUNTERS}
    responses = sum(int(group["input_ids"].shape[0]) for group in batch)
    return {"seconds": seconds, "responses": responses, "responses_per_s": responses / seconds,
            "output_tokens": delta["generated"], "accepted_tokens": delta["accepted"],
            "accepted_share": delta["accepted"] / max(delta["generated"], 1.0),
            "tokens_per_verification": (delta["accepted"] + delta["drafts"]) / max(delta["drafts"], 1.0)}


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per engine")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (the GRPO group)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--json", dest="json_path")
    return parser.parse_args()


def rlvr_workflow(max_new_tokens: int) -> Any:
    """AReaL's RLVR workflow over the built-in model's tokenizer, sampling at temperature 1, scoring nothing."""
    from areal.api.cli_args import GenerationHyperparameters, NameResolveConfig
    from areal.utils import name_resolve
    from areal.workflow import RLVRWorkflow
    from transformers import AutoTokenizer

    from samrollout.models import ensure_smollm2

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=tempfile.mkdtemp()))
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    return RLVRWorkflow(reward_fn=zero_reward, tokenizer=tokenizer, gconfig=GenerationHyperparameters(
        max_new_tokens=max_new_tokens, temperature=1.0))


@contextmanager
def started_engines(args: argparse.Namespace, urls: list[str]) -> Iterator[dict[str, Any]]:
    """AReaL's engine and ours, initialised against the servers at ``urls``; destroyed however the block ends."""
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.vllm_remote import RemotevLLMEngine

    from samrollout_client.areal import SamrolloutEngine

    os.environ["AREAL_LLM_SERVER_ADDRS"] = ",".join(url.removeprefix("http://") for url in urls)
    engines: dict[str, Any] = {}
    try:
        for name, kind in zip(ENGINES, (RemotevLLMEngine, SamrolloutEngine), strict=True):
            engines[name] = kind(InferenceEngineConfig(
                backend=f"vllm:d{args.servers}", experiment_name="bench", trial_name=name,
                max_concurrent_rollouts=args.prompts * args.n, consumer_batch_size=args.prompts * args.n,
                max_head_offpolicyness=args.epochs, request_timeout=3600))
            engines[name].initialize()
        yield engines
    finally:
        for engine in engines.values():
            engine.destroy()


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Start the servers and both engines, roll out every epoch, the engines alternating: each engine's epochs."""
    flow = rlvr_workflow(args.max_new_tokens)  # the built-in model converted once, before the servers start
    servers = launch_servers(args.servers, ["--areal-routes", "--max-model-len", "1024", "--gpu-memory-utilization",
                                            "0.1", "--log-level", "warning"], "samrollout-areal-bench")
    data = {name: questions(seed, args.prompts) for seed, name in enumerate(ENGINES)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ENGINES}
    with serving(servers) as urls, started_engines(args, urls) as engines:
        for index, name in interleaved(ENGINES, args.epochs):
            result = epoch(engines[name], data[name], flow, args.n, urls)
            runs[name].append(result)
            print(f"epoch {index + 1}/{args.epochs} {name:<11}: {result['seconds']:.1f} s, "
                  f"{result['accepted_share']:.1%} of tokens from drafts", file=sys.stderr, flush=True)
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per engine: seconds over every epoch, and the share of tokens from drafts, in all and after the first."""
    return {name: {"seconds_total": sum(r["seconds"] for r in rows),
                   "accepted_share_mean": statistics.fmean(r["accepted_share"] for r in rows),
                   "accepted_share_after_first_epoch": statistics.fmean(r["accepted_share"] for r in rows[1:])
                   if len(rows) > 1 else None}
            for name, rows in runs.items()}


def print_table(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]],
                summary: dict[str, dict[str, Any]]) -> None:
    """Every epoch of each engine, then each engine's totals."""
    print(f"\n{args.servers} servers, {args.prompts} prompts x n={args.n} per engine, {args.max_new_tokens} new "
          "tokens at most, temperature 1")
    print(f"{'epoch':<7}{'engine':<12}{'seconds':>9}{'responses/s':>13}{'output tokens':>15}{'from drafts':>13}"
          f"{'tokens/verif.':>15}")
    for index in range(args.epochs):
        for name in ENGINES:
            row = runs[name][index]
            print(f"{index + 1:<7}{name:<12}{row['seconds']:>9.1f}{row['responses_per_s']:>13.2f}"
                  f"{row['output_tokens']:>15.0f}{row['accepted_share']:>13.1%}{row['tokens_per_verification']:>15.2f}")
    for name, totals in summary.items():
        print(f"{name}: {totals['seconds_total']:.1f} s over {args.epochs} epochs; {totals['accepted_share_mean']:.1%} "
              "of tokens from drafts")


def main() -> None:
    """Start the servers, alternate the engines epoch by epoch, print the table, write the JSON."""
    args = parse_args()
    runs = run(args)
    summary = summarise(runs)
    print_table(args, runs, summary)
    if args.json_path:
        write_json(args.json_path, {"model": "SmolLM2-135M-Instruct (built-in)", "servers": args.servers,
                                    "prompts": args.prompts, "n": args.n, "epochs": args.epochs,
                                    "max_new_tokens": args.max_new_tokens, "runs": runs, "summary": summary,
                                    **host()})


if __name__ == "__main__":
    main()
