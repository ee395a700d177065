"""``samrollout replay``: would speculation help on my rollouts? Peers side by side, same tokens."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from samrollout.drafter import DraftPolicy
from samrollout.replay import long_context, report
from samrollout.replay.registry import DEFAULT_DRAFTERS, factory
from samrollout.replay.simulate import ReplayResult, replay
from samrollout.replay.traces import TraceError, load_traces, vocab_size

DEFAULT_TRACES = "bench/data/smollm2-math-groups.jsonl.gz"


def add_replay_parser(commands: Any) -> None:
    """Register the ``replay`` sub-command."""
    p = commands.add_parser("replay", help="replay recorded rollouts under a greedy oracle verifier",
                            description=__doc__)
    p.add_argument("--traces", default=DEFAULT_TRACES,
                   help=f"JSONL(.gz) of responses: prompt_ids/response_ids or prompt/response text, and a "
                        f"group key prompt_id (default: the bundled {DEFAULT_TRACES})")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer path for text traces")
    p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS),
                   help=f"comma-separated, in table order (default: {','.join(DEFAULT_DRAFTERS)})")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--max-groups", type=int, help="replay only the first N prompt groups")
    p.add_argument("--tail-rows", type=int, default=16,
                   help="the tail: positions where, without speculation, at most this many responses still "
                        "run (default 16); its MAL is reported on its own")
    p.add_argument("--long-context", default="8192,16384,32768",
                   help="context lengths for the per-step cost table ('' to skip)")
    p.add_argument("--long-context-rows", type=int, default=8,
                   help="rows per step in the long-context table (default 8: the tail batch at threshold 8)")
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--plot", help="write a PNG of MAL and cost per drafter")
    policy = p.add_argument_group("SAM draft policy (sam, sam-group)")
    defaults = DraftPolicy()
    policy.add_argument("--occurrence", choices=["first", "recent"], default=defaults.occurrence)
    policy.add_argument("--min-match", type=_min_match, default=defaults.min_match_length,
                        help='shortest match that drafts, or "auto" (1 outside an engine)')
    policy.add_argument("--match-scale", type=float, default=defaults.match_scale)
    policy.add_argument("--source", choices=["own", "group", "both"], default=defaults.source)
    p.set_defaults(run=run)


def _min_match(text: str) -> int | str:
    """``--min-match`` value: a positive integer or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """Replay the traces through every drafter; print tables, write JSON and plot."""
    try:
        groups = load_traces(args.traces, args.tokenizer, args.max_groups)
        policy = DraftPolicy(occurrence=args.occurrence, min_match_length=args.min_match,
                             match_scale=args.match_scale, source=args.source).for_hardware(on_cpu=False)
    except (TraceError, ValueError) as error:
        print(f"samrollout replay: {error}", file=sys.stderr)
        return 2
    vocab = vocab_size(groups)
    lengths = [int(x) for x in args.long_context.split(",") if x.strip()]
    responses = sum(len(g.responses) for g in groups)
    tokens = sum(len(r) for g in groups for r in g.responses)
    print(f"traces: {args.traces}: {len(groups)} groups, {responses} responses, {tokens} response tokens; "
          f"k={args.k}; policy {policy.as_dict()}")
    results: list[ReplayResult] = []
    costs: list[long_context.LongContextCost] = []
    unavailable: dict[str, str] = {}
    for name in [n.strip() for n in args.drafters.split(",") if n.strip()]:
        make = factory(name, vocab, policy)
        try:
            drafter = make()
        except RuntimeError as error:
            unavailable[name] = str(error)
            print(f"skipped {error}", file=sys.stderr)
            continue
        except ValueError as error:
            print(f"samrollout replay: {error}", file=sys.stderr)
            return 2
        results.append(replay(drafter, groups, args.k, tail_rows=args.tail_rows))
        if lengths:
            costs += long_context.measure(make, groups, lengths, args.k, rows=args.long_context_rows)
    print()
    print(report.format_table(results))
    if costs:
        print(f"\nper row-step drafter cost at long context ({args.long_context_rows} rows per step):")
        print(report.format_long_context(costs))
    for why in unavailable.values():
        print(f"\nnot run: {why}")
    meta = {"traces": args.traces, "groups": len(groups), "responses": responses, "response_tokens": tokens,
            "k": args.k, "policy": policy.as_dict(), "unavailable": unavailable}
    if args.json:
        report.write_json(args.json, results, costs, meta)
    if args.plot:
        report.write_plot(args.plot, results, costs, f"replay of {len(groups)} groups, k={args.k}")
    return 0
