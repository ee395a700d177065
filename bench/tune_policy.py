"""Sweep the SAM draft policy on a trace file; the defaults in `DraftPolicy` come from this.

    python bench/tune_policy.py --traces bench/data/smollm2-math-groups.jsonl.gz --json out/tune.json

Prints one row per policy (MAL, acceptance rate, draft tokens per step) for the
per-request drafter and the group drafter, best MAL first.
"""

from __future__ import annotations

import argparse
import itertools

from harness import write_json
from samrollout.drafter import DraftPolicy
from samrollout.replay.drafters import SamReplayDrafter
from samrollout.replay.simulate import replay
from samrollout.replay.traces import load_traces, vocab_size


def main() -> None:
    """Run the sweep and print/write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="bench/data/smollm2-math-groups.jsonl.gz")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-groups", type=int)
    parser.add_argument("--json")
    args = parser.parse_args()
    groups = load_traces(args.traces, max_groups=args.max_groups)
    vocab = vocab_size(groups)
    rows = []
    grid = itertools.product(["own", "both", "group"], ["first", "recent"], [1, 2, 3, 4], [0.0, 0.5, 1.0])
    for source, occurrence, min_match, scale in grid:
        policy = DraftPolicy(occurrence=occurrence, min_match_length=min_match, match_scale=scale, source=source)
        result = replay(SamReplayDrafter("sam", vocab, policy, group=source != "own"), groups, args.k)
        row = {**policy.as_dict(), **result.as_dict()}
        rows.append(row)
        print(f"{source:<6}{occurrence:<8}min={min_match} scale={scale:<4} MAL={row['mean_acceptance_length']:.4f} "
              f"accept={row['acceptance_rate']:.3f} draft/step={row['draft_tokens_per_step']:.2f}", flush=True)
    rows.sort(key=lambda r: -r["mean_acceptance_length"])
    print("\nbest by MAL:")
    for r in rows[:10]:
        print(f"  {r['source']:<6}{r['occurrence']:<8}min={r['min_match_length']} scale={r['match_scale']:<4}"
              f" MAL={r['mean_acceptance_length']:.4f} accept={r['acceptance_rate']:.3f}")
    if args.json:
        write_json(args.json, {"traces": args.traces, "k": args.k, "rows": rows})


if __name__ == "__main__":
    main()
