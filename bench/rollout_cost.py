"""What a GRPO rollout costs through the client, with and without SAM: makespan, tail, tokens/s.

    python bench/rollout_cost.py --groups 64 --n 8 --json bench/results/rollout-cost-cpu.json

For each server mode (SAM off, SAM with the adaptive threshold) it starts `samrollout
serve` with the built-in model, runs the same rollout (the arithmetic prompts of
`examples/grpo_loop.py`, same seeds) through `samrollout_client` at each temperature,
and reports the server's rollout summary.  On vLLM's CPU backend SAM drafts only for
greedy requests (see docs/tuning.md), so the temperature-1.0 rows show what the threshold costs
when nothing is drafted, and the greedy rows what drafting gains.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

MODES = {"off": ["--no-speculation"], "sam": ["--threshold-mode", "adaptive"],
         # vLLM turns async scheduling off for custom_class proposers: this isolates that cost.
         "off-sync": ["--no-speculation", "--", "--no-async-scheduling"]}


def _grpo_loop() -> Any:
    """examples/grpo_loop.py as a module (an example script, not a package): its prompts are the workload."""
    spec = importlib.util.spec_from_file_location("grpo_loop", ROOT / "examples" / "grpo_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_rollout(url: str, args: argparse.Namespace, temperature: float, rollout_id: str) -> dict[str, Any]:
    """One rollout of groups x n through the client; the server's summary plus client-side wall time."""
    from samrollout_client import RolloutClient, Sampling

    questions = _grpo_loop().make_questions(args.groups, random.Random(args.seed))
    with RolloutClient(url, model="smollm2-135m-instruct", max_in_flight=args.max_in_flight) as client:
        start = time.perf_counter()
        client.generate([q for q, _ in questions], n=args.n, rollout_id=rollout_id,
                        sampling=Sampling(max_tokens=args.max_tokens, temperature=temperature, seed=args.seed))
        wall = time.perf_counter() - start
        time.sleep(2.5)
        report = client.report(rollout_id).model_dump()
    return {**report, "client_wall_s": wall, "tokens_per_s": report["output_tokens"] / wall}


def main() -> None:
    """Run every mode and temperature, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-in-flight", type=int, default=128)
    parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["off", "sam"], help=f"of {list(MODES)}")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    from samrollout.testing import start_server

    rows = []
    for mode in args.modes:
        flags = MODES[mode]
        extra = flags[flags.index("--"):] if "--" in flags else []
        own = flags[:flags.index("--")] if "--" in flags else flags
        log = Path(f"/tmp/samrollout-rollout-cost-{mode}.log")
        server = start_server([*own, "--log-level", "warning", *extra], log)
        try:
            for temperature in args.temperatures:
                result = run_rollout(server.url, args, temperature, f"cost-{mode}-t{temperature}")
                rows.append({"mode": mode, "temperature": temperature, **result})
        finally:
            server.stop()
    print(f"{'mode':<8} {'temp':>4} {'samples':>7} {'tokens':>7} {'makespan s':>10} {'tail s':>7} {'tail %':>6} "
          f"{'tok/s':>7} {'accept len':>10}")
    for row in rows:
        mal = f"{row['mean_acceptance_length']:.2f}" if row["mean_acceptance_length"] else "-"
        print(f"{row['mode']:<8} {row['temperature']:>4.1f} {row['sequences']:>7} {row['output_tokens']:>7} "
              f"{row['makespan_s']:>10.1f} {row['tail_s']:>7.1f} {100 * row['tail_share']:>6.1f} "
              f"{row['tokens_per_s']:>7.0f} {mal:>10}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
