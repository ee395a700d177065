"""``samrollout replay``: would speculation help on my rollouts? Peers side by side, same tokens.

By default every drafter drafts as the engine would: ours (sam, sam-group, sam-ref) and the
oracle with samrollout's engine defaults (SpeculationConfig: k=3, static threshold 8, i.e. in a
round with more than 8 running responses only rows matching 8+ tokens draft, confident_match;
min_match_length "auto" as on GPUs and NPUs: 1), vLLM's peers with vLLM's defaults (no
batch-size threshold; suffix k=24, vLLM's default for method "suffix", though match + draft
must fit its 24-token tree, so it drafts at most 12; ngram has no default k in vLLM and gets
3).  --k forces one k for all, --threshold changes our gate.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from samrollout.drafter import DraftPolicy
from samrollout.replay import long_context, report
from samrollout.replay.oracle import SourceOracle
from samrollout.replay.registry import (
    DEFAULT_DRAFTERS,
    DEFAULT_ORACLE_SOURCES,
    ENGINE,
    ORACLE,
    OWN_SOURCES,
    VLLM_SUFFIX_DEFAULT_K,
    engine_k,
    engine_threshold,
    factory,
    make_source,
)
from samrollout.replay.simulate import replay
from samrollout.replay.traces import (
    ResponseFilter,
    TraceError,
    TraceGroup,
    load_traces,
    parse_where,
    select,
    split_paths,
    vocab_size,
)

DEFAULT_TRACES = "bench/data/smollm2-math-groups.jsonl.gz"
MAX_K = 64


def add_replay_parser(commands: Any) -> None:
    """Register the ``replay`` sub-command."""
    p = commands.add_parser("replay", help="replay recorded rollouts under a greedy oracle verifier",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", action="append",
                   help=f"JSONL(.gz) of responses: prompt_ids/response_ids or prompt/response text, a group key "
                        f"prompt_id and optionally a meta object; repeat the flag or separate files by commas to "
                        f"replay several (each is its own rollout and table; default: the bundled "
                        f"{DEFAULT_TRACES})")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer path for text traces")
    p.add_argument("--responses", choices=["all", "clean", "both"], default="all",
                   help="which responses to replay: all (default); clean: meta.finished and not meta.tail_loop "
                        "(records without those fields count as clean); both: one table for each")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="also keep only responses whose meta[KEY] equals VALUE (read as JSON where it parses, "
                        "e.g. correct=true); repeatable")
    p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS),
                   help=f"comma-separated, in table order (default: {','.join(DEFAULT_DRAFTERS)})")
    p.add_argument("--oracle-sources", action="append",
                   help="comma-separated sources of an oracle row (not a drafter: per step the best of their "
                        "drafts, picked knowing the truth; every source drafts at the oracle's k): own (the "
                        "request's automaton), group (its group's) and any drafter name; repeat for several "
                        f"oracle rows, '' for none (default: {','.join(DEFAULT_ORACLE_SOURCES)})")
    p.add_argument("--k", type=_k, default=None,
                   help=f"force this many draft tokens per step for every drafter and the oracle (default: as "
                        f"the engine would: {ENGINE.k} for ours and ngram, 24 for vLLM's suffix)")
    p.add_argument("--threshold", type=_threshold, default="engine",
                   help=f"our drafters and the oracle draft only in rounds with at most this many running "
                        f"responses; 'off': every round (default 'engine': the engine's static threshold, "
                        f"{engine_threshold('sam')}). vLLM's peers draft in every round, as vLLM does")
    p.add_argument("--history", type=int, default=0, metavar="N",
                   help="an earlier rollout: each group's first N responses (after the filters; file order, e.g. "
                        "earlier checkpoints) are not replayed but given first to drafters that keep responses "
                        "across rollouts (sam-history, suffix-cache's global tree); groups with no response left "
                        "are dropped. With N > 0 the default drafters include sam-history (default 0)")
    p.add_argument("--confident-match", type=int, default=ENGINE.confident_match, metavar="TOKENS",
                   help="in rounds past our threshold, our drafters still draft from matches at least this long, "
                        f"as the engine's confident_match does (default: the engine's, {ENGINE.confident_match})")
    p.add_argument("--max-groups", type=int, help="replay only the first N prompt groups of each file")
    p.add_argument("--tail-rows", type=int, default=ENGINE.threshold,
                   help=f"the tail: positions where, without speculation, at most this many responses still run "
                        f"(default {ENGINE.threshold}, the engine's threshold: where it drafts); its MAL is "
                        f"reported on its own")
    p.add_argument("--long-context", default="8192,16384,32768",
                   help="context lengths for the per-step cost table, measured on the first file ('' to skip)")
    p.add_argument("--long-context-rows", type=int, default=8,
                   help="rows per step in the long-context table (default 8: the tail batch at threshold 8)")
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--plot", help="write a PNG of MAL and cost per drafter")
    policy = p.add_argument_group("SAM draft policy (sam, sam-group, the oracle's own and group sources)")
    defaults = DraftPolicy()
    policy.add_argument("--occurrence", choices=["first", "recent", "frequent"], default=defaults.occurrence)
    policy.add_argument("--min-probability", type=float, default=defaults.min_probability,
                        help="frequent occurrence: a draft stops where its estimated acceptance probability "
                             "falls below this")
    policy.add_argument("--min-match", type=_min_match, default=defaults.min_match_length,
                        help='shortest match that drafts, or "auto" (1: the engine on GPUs and NPUs)')
    policy.add_argument("--match-scale", type=float, default=defaults.match_scale)
    policy.add_argument("--source", choices=["own", "group", "both"], default=defaults.source)
    policy.add_argument("--global-tokens", type=int, default=defaults.max_global_tokens, metavar="N",
                        help="the global index of finished responses (max_global_tokens) for every SAM drafter; "
                             "sam-global uses 2**22 when this is 0 (default: the engine's, 0)")
    policy.add_argument("--global-margin", type=int, default=defaults.global_margin, metavar="TOKENS",
                        help="a global draft wins when its match is longer than own/group's by more than this")
    p.set_defaults(run=run)


def _min_match(text: str) -> int | str:
    """``--min-match`` value: a positive integer or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def _k(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= k <= MAX_K:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_K}, got {k}")
    return k


def _threshold(text: str) -> int | str | None:
    if text in ("engine", "off"):
        return None if text == "off" else text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, 'engine' or 'off', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _count_tokens(groups: list[TraceGroup]) -> int:
    return sum(len(r) for g in groups for r in g.responses)


def run(args: argparse.Namespace) -> int:
    """Replay every trace file (under each response filter) through every drafter and the oracle;
    print tables, write JSON and plot."""
    paths = split_paths(args.traces) or [DEFAULT_TRACES]
    drafters = _names(args.drafters)
    if args.history < 0:
        print("samrollout replay: --history must be >= 0", file=sys.stderr)
        return 2
    if args.history and args.drafters == ",".join(DEFAULT_DRAFTERS):
        drafters.insert(drafters.index("sam-group") + 1, "sam-history")
    oracles = [names for names in map(_names, args.oracle_sources or [",".join(DEFAULT_ORACLE_SOURCES)]) if names]
    filters: list[ResponseFilter] = ["clean", "all"] if args.responses == "both" else [args.responses]
    try:
        where = [parse_where(w) for w in args.where]
        policy = DraftPolicy(occurrence=args.occurrence, min_match_length=args.min_match,
                             match_scale=args.match_scale, source=args.source,
                             max_global_tokens=args.global_tokens,
                             global_margin=args.global_margin,
                             min_probability=args.min_probability).for_hardware(on_cpu=False)
        if ORACLE in drafters:
            raise ValueError("the oracle is not a drafter you can pick: it is its own row (--oracle-sources)")
        files = {path: load_traces(path, args.tokenizer, args.max_groups) for path in paths}
    except (TraceError, ValueError) as error:
        print(f"samrollout replay: {error}", file=sys.stderr)
        return 2
    k_of = {name: args.k or engine_k(name) for name in [*drafters, ORACLE]}
    threshold_of = {name: (engine_threshold(name) if args.threshold == "engine" or engine_threshold(name) is None
                           else args.threshold) for name in [*drafters, ORACLE]}
    print(_plan(drafters, oracles, k_of, threshold_of, policy))
    if args.confident_match:
        print(f"  past the threshold, ours still draft from matches of {args.confident_match}+ tokens "
              f"(--confident-match)")

    runs: list[report.ReplayRun] = []
    unavailable: dict[str, str] = {}
    for path, all_groups in files.items():
        vocab = vocab_size(all_groups)
        for which in filters:
            groups, earlier = split_history(select(all_groups, which, where), args.history)
            total = sum(len(g.responses) for g in all_groups)
            run_ = report.ReplayRun(path, which, len(groups), sum(len(g.responses) for g in groups),
                                    _count_tokens(groups), sum(1 for g in groups if len(g.responses) == 1))
            header = (f"== {path}, responses: {which}{' ' + ' '.join(args.where) if where else ''}: "
                      f"{run_.responses_count} of {total} responses in {len(groups)} of {len(all_groups)} groups, "
                      f"{run_.response_tokens} response tokens")
            print(f"\n{header}")
            if args.history:
                run_.note = (f"--history {args.history}: {sum(len(e) for e in earlier)} earlier responses "
                             f"given first, not replayed")
                print(f"   ({run_.note})")
            if args.max_groups is not None:
                run_.note = f"--max-groups {args.max_groups}: the first {len(all_groups)} groups of the file"
                print(f"   ({run_.note})")
            if run_.single_response_groups:
                print(f"   {run_.single_response_groups} group(s) have a single response: they replay with their "
                      f"own text only (no sibling to draft from)")
            if not groups:
                print("   no responses pass the filter: nothing to replay")
                runs.append(run_)
                continue
            for name in drafters:
                try:
                    drafter = factory(name, vocab, policy, args.confident_match)()
                except RuntimeError as error:
                    if name not in unavailable:
                        print(f"skipped {error}", file=sys.stderr)
                    unavailable[name] = str(error)
                    continue
                except ValueError as error:
                    print(f"samrollout replay: {error}", file=sys.stderr)
                    return 2
                start = time.perf_counter()
                run_.results.append(replay(drafter, groups, k_of[name], args.tail_rows, threshold_of[name],
                                           earlier))
                run_.seconds[name] = time.perf_counter() - start
            for sources in oracles:
                try:
                    oracle = SourceOracle([(s, make_source(s, vocab, policy)) for s in sources])
                except (RuntimeError, ValueError) as error:
                    print(f"samrollout replay: oracle source {error}", file=sys.stderr)
                    return 2
                start = time.perf_counter()
                run_.results.append(replay(oracle, groups, k_of[ORACLE], args.tail_rows, threshold_of[ORACLE],
                                           earlier))
                run_.seconds[oracle.name] = time.perf_counter() - start
            print(report.format_table(run_.results))
            runs.append(run_)

    costs = _long_context(args, paths[0], files[paths[0]], [r.name for r in runs[0].results if not r.is_oracle],
                          k_of, policy) if runs and runs[0].results else []
    for why in unavailable.values():
        print(f"\nnot run: {why}")
    meta = {"options": {key: value for key, value in vars(args).items() if key != "run"},
            "traces": paths, "responses": filters, "where": args.where, "max_groups": args.max_groups,
            "k": {name: k_of[name] for name in [*drafters, ORACLE] if name not in unavailable},
            "drafts_at_most_running": {name: threshold_of[name] for name in [*drafters, ORACLE]
                                       if name not in unavailable},
            "oracle_sources": oracles, "policy": policy.as_dict(), "tail_rows": args.tail_rows,
            "engine_defaults": {"k": ENGINE.k, "threshold_mode": ENGINE.threshold_mode,
                                "threshold": ENGINE.threshold, "min_match_length": "auto (1 on GPUs and NPUs)"},
            "long_context_traces": paths[0], "unavailable": unavailable}
    if args.json:
        report.write_json(args.json, runs, costs, meta)
    if args.plot and any(run_.results for run_ in runs):
        report.write_plot(args.plot, [r for r in runs if r.results], costs, plot_title(args.k, threshold_of[ORACLE]))
    return 0


def split_history(groups: list[TraceGroup], count: int) -> tuple[list[TraceGroup], list[list[np.ndarray]]]:
    """Each group's first ``count`` responses become an earlier rollout's; groups left empty are dropped.
    Returns (the groups to replay, their earlier responses, index for index)."""
    if count == 0:
        return groups, [[] for _ in groups]
    kept = [g for g in groups if len(g.responses) > count]
    return ([TraceGroup(g.key, g.prompt, g.responses[count:], g.meta[count:]) for g in kept],
            [g.responses[:count] for g in kept])


def plot_title(k: int | None, threshold: int | None) -> str:
    """What the plot shows: the k used and when our drafters draft."""
    k_text = (f"k={k} for all" if k else
              f"as the engine would: k={ENGINE.k} (ours, ngram), {VLLM_SUFFIX_DEFAULT_K} (suffix)")
    gate = "every round" if threshold is None else f"at <={threshold} running"
    return f"replay, {k_text}; ours and the oracles draft {gate}, vLLM's peers every round"


def _plan(drafters: list[str], oracles: list[list[str]], k_of: dict[str, int], threshold_of: dict[str, int | None],
          policy: DraftPolicy) -> str:
    """One line per drafter: its k and when it drafts (what "as the engine would" resolved to)."""
    lines = ["drafting plan (k, and the most running responses at which a round drafts):"]

    def when(name: str) -> str:
        return "every round" if threshold_of[name] is None else f"<= {threshold_of[name]} running"

    for name in drafters:
        lines.append(f"  {name:<14} k={k_of[name]:<3} {when(name)}")
    for sources in oracles:
        lines.append(f"  {ORACLE:<14} k={k_of[ORACLE]:<3} {when(ORACLE)}, sources {'+'.join(sources)} "
                     f"(not a drafter: the best source per step)")
    own = any(s in OWN_SOURCES for sources in oracles for s in sources)
    lines.append(f"  SAM policy {policy.as_dict()}" + (" (also the oracle's own and group sources)" if own else ""))
    return "\n".join(lines)


def _long_context(args: argparse.Namespace, path: str, groups: list[TraceGroup], names: list[str], k_of: dict[str, int],
                  policy: DraftPolicy) -> list[long_context.LongContextCost]:
    lengths = [int(x) for x in args.long_context.split(",") if x.strip()]
    if not lengths:
        return []
    vocab = vocab_size(groups)
    costs: list[long_context.LongContextCost] = []
    for name in names:
        costs += long_context.measure(factory(name, vocab, policy), groups, lengths, k_of[name],
                                      rows=args.long_context_rows)
    print(f"\nper row-step drafter cost at long context ({args.long_context_rows} rows per step, "
          f"tokens of {path}):")
    print(report.format_long_context(costs))
    return costs

