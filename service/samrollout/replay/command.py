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
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin

import numpy as np

from samrollout.drafter import DraftPolicy, policy_field_types
from samrollout.replay import long_context, report
from samrollout.replay.oracle import SourceOracle
from samrollout.replay.peers import add_suffix_flags, suffix_from_args
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
    response_filters,
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
    add_suffix_flags(p)
    add_policy_flags(p.add_argument_group("SAM draft policy (sam, sam-group, the oracle's own and group sources)"))
    p.set_defaults(run=run)


# The replay's flags for DraftPolicy fields are made from the dataclass: each field gets --its-name with
# its type, choices, default and description.  These keep the flag names and metavars they had, plus a
# note on how the replay uses them; the fields in POLICY_FIELDS_WITHOUT_FLAGS keep the policy's defaults.
POLICY_FLAG_OVERRIDES: dict[str, dict[str, str]] = {
    "min_match_length": {"flag": "--min-match"},
    "max_global_tokens": {"flag": "--global-tokens", "metavar": "N",
                          "note": "for every SAM drafter; sam-global uses 2**22 when this is 0"},
    "global_margin": {"metavar": "TOKENS"},
}
POLICY_FIELDS_WITHOUT_FLAGS = frozenset({"group_margin", "max_request_tokens", "max_group_tokens"})


def policy_flags() -> dict[str, str]:
    """The DraftPolicy fields the replay takes as flags, each with its flag."""
    return {knob.name: POLICY_FLAG_OVERRIDES.get(knob.name, {}).get("flag", "--" + knob.name.replace("_", "-"))
            for knob in fields(DraftPolicy) if knob.name not in POLICY_FIELDS_WITHOUT_FLAGS}


def add_policy_flags(group: Any) -> None:
    """One flag per DraftPolicy field (`policy_flags`), typed and documented from the dataclass."""
    defaults = DraftPolicy()
    types = policy_field_types()
    descriptions = {knob.name: knob.metadata.get("description", "") for knob in fields(DraftPolicy)}
    for name, flag in policy_flags().items():
        override = POLICY_FLAG_OVERRIDES.get(name, {})
        text = "; ".join(part for part in (descriptions[name], override.get("note", "")) if part)
        options: dict[str, Any] = {"default": getattr(defaults, name), "help": text.replace("%", "%%")}
        if "metavar" in override:
            options["metavar"] = override["metavar"]
        choices = _literal_choices(types[name])
        if get_origin(types[name]) is Literal:
            options["choices"] = list(choices)
        else:
            options["type"] = _flag_type(name, types[name])
        group.add_argument(flag, **options)


def policy_from_args(args: argparse.Namespace) -> DraftPolicy:
    """The DraftPolicy the policy flags give (fields without a flag keep their defaults)."""
    return DraftPolicy(**{name: getattr(args, flag[2:].replace("-", "_")) for name, flag in policy_flags().items()})


def _literal_choices(hint: Any) -> tuple[str, ...]:
    """The Literal strings a field annotation allows (its Literal arms)."""
    if get_origin(hint) is Literal:
        return tuple(get_args(hint))
    return tuple(choice for arm in get_args(hint) if get_origin(arm) is Literal for choice in get_args(arm))


def _flag_type(name: str, hint: Any) -> Callable[[str], Any]:
    """A flag's parser for a field annotation: int, float, or a number that may also be one of some words."""
    words = _literal_choices(hint)
    number: type = float if hint is float or float in get_args(hint) else int
    if not words:
        return number

    def parse(text: str) -> Any:
        if text in words:
            return text
        try:
            return number(text)
        except ValueError:
            kind = "an integer" if number is int else "a number"
            allowed = " or ".join([kind, *(repr(w) for w in words)])
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None

    parse.__name__ = name  # argparse names it in "invalid ... value" messages
    return parse


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


class ReplayError(Exception):
    """A replay that cannot go on: the message for ``samrollout replay: ...`` (exit status 2)."""


@dataclass
class ReplayPlan:
    """What the flags resolved to: the files (loaded), drafters, oracle rows, response filters, the SAM
    policy, and each drafter's k and threshold (None: it drafts in every round)."""

    paths: list[str]
    files: dict[str, list[TraceGroup]]
    drafters: list[str]
    oracles: list[list[str]]
    filters: list[ResponseFilter]
    where: list[tuple[str, Any]]
    policy: DraftPolicy
    k_of: dict[str, int]
    threshold_of: dict[str, int | None]


def run(args: argparse.Namespace) -> int:
    """Replay every trace file (under each response filter) through every drafter and the oracle;
    print tables, write JSON and plot."""
    try:
        replay_plan = plan(args)
    except (TraceError, ValueError) as error:
        print(f"samrollout replay: {error}", file=sys.stderr)
        return 2
    print(_format_plan(replay_plan))
    if args.confident_match:
        print(f"  past the threshold, ours still draft from matches of {args.confident_match}+ tokens "
              f"(--confident-match)")
    try:
        runs, unavailable = run_replays(args, replay_plan)
    except ReplayError as error:
        print(f"samrollout replay: {error}", file=sys.stderr)
        return 2
    report_results(args, replay_plan, runs, unavailable)
    return 0


def plan(args: argparse.Namespace) -> ReplayPlan:
    """Resolve the flags and load the traces; ValueError or TraceError says what is wrong."""
    paths = split_paths(args.traces) or [DEFAULT_TRACES]
    drafters = _names(args.drafters)
    if args.history < 0:
        raise ValueError("--history must be >= 0")
    if args.history and args.drafters == ",".join(DEFAULT_DRAFTERS):
        drafters.insert(drafters.index("sam-group") + 1, "sam-history")
    oracles = [names for names in map(_names, args.oracle_sources or [",".join(DEFAULT_ORACLE_SOURCES)]) if names]
    filters = response_filters(args.responses)
    where = [parse_where(w) for w in args.where]
    policy = policy_from_args(args).for_hardware(on_cpu=False)
    if ORACLE in drafters:
        raise ValueError("the oracle is not a drafter you can pick: it is its own row (--oracle-sources)")
    files = {path: load_traces(path, args.tokenizer, args.max_groups) for path in paths}
    suffix_from_args(args)  # settings out of vLLM's bounds: a clear error before anything runs
    k_of = {name: args.k or engine_k(name) for name in [*drafters, ORACLE]}
    k_of.update({name: args.k or suffix_from_args(args).num_speculative_tokens
                 for name in drafters if name in ("suffix", "suffix-cache")})
    threshold_of = {name: (engine_threshold(name) if args.threshold == "engine" or engine_threshold(name) is None
                           else args.threshold) for name in [*drafters, ORACLE]}
    return ReplayPlan(paths, files, drafters, oracles, filters, where, policy, k_of, threshold_of)


def run_replays(args: argparse.Namespace, p: ReplayPlan) -> tuple[list[report.ReplayRun], dict[str, str]]:
    """Replay each file under each filter through every drafter and oracle row, printing each table.
    Returns the runs and the drafters that could not run (name -> why); ReplayError stops the replay."""
    runs: list[report.ReplayRun] = []
    unavailable: dict[str, str] = {}
    for path, all_groups in p.files.items():
        vocab = vocab_size(all_groups)
        for which in p.filters:
            groups, earlier = split_history(select(all_groups, which, p.where), args.history)
            total = sum(len(g.responses) for g in all_groups)
            run_ = report.ReplayRun(path, which, len(groups), sum(len(g.responses) for g in groups),
                                    _count_tokens(groups), sum(1 for g in groups if len(g.responses) == 1))
            header = (f"== {path}, responses: {which}{' ' + ' '.join(args.where) if p.where else ''}: "
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
            for name in p.drafters:
                try:
                    drafter = factory(name, vocab, p.policy, args.confident_match, suffix_from_args(args))()
                except RuntimeError as error:
                    if name not in unavailable:
                        print(f"skipped {error}", file=sys.stderr)
                    unavailable[name] = str(error)
                    continue
                except ValueError as error:
                    raise ReplayError(str(error)) from error
                start = time.perf_counter()
                run_.results.append(replay(drafter, groups, p.k_of[name], args.tail_rows, p.threshold_of[name],
                                           earlier))
                run_.seconds[name] = time.perf_counter() - start
            for sources in p.oracles:
                try:
                    oracle = SourceOracle([(s, make_source(s, vocab, p.policy)) for s in sources])
                except (RuntimeError, ValueError) as error:
                    raise ReplayError(f"oracle source {error}") from error
                start = time.perf_counter()
                run_.results.append(replay(oracle, groups, p.k_of[ORACLE], args.tail_rows, p.threshold_of[ORACLE],
                                           earlier))
                run_.seconds[oracle.name] = time.perf_counter() - start
            print(report.format_table(run_.results))
            runs.append(run_)
    return runs, unavailable


def report_results(args: argparse.Namespace, p: ReplayPlan, runs: list[report.ReplayRun],
                   unavailable: dict[str, str]) -> None:
    """The long-context cost table, what could not run, the JSON file and the plot."""
    first = p.paths[0]
    costs = _long_context(args, first, p.files[first], [r.name for r in runs[0].results if not r.is_oracle],
                          p.k_of, p.policy) if runs and runs[0].results else []
    for why in unavailable.values():
        print(f"\nnot run: {why}")
    names = [*p.drafters, ORACLE]
    meta = {"options": {key: value for key, value in vars(args).items() if key != "run"},
            "traces": p.paths, "responses": p.filters, "where": args.where, "max_groups": args.max_groups,
            "k": {name: p.k_of[name] for name in names if name not in unavailable},
            "drafts_at_most_running": {name: p.threshold_of[name] for name in names if name not in unavailable},
            "oracle_sources": p.oracles, "policy": p.policy.as_dict(), "tail_rows": args.tail_rows,
            "engine_defaults": {"k": ENGINE.k, "threshold_mode": ENGINE.threshold_mode,
                                "threshold": ENGINE.threshold, "min_match_length": "auto (1 on GPUs and NPUs)"},
            "long_context_traces": first, "unavailable": unavailable}
    if args.json:
        report.write_json(args.json, runs, costs, meta)
    if args.plot and any(run_.results for run_ in runs):
        report.write_plot(args.plot, [r for r in runs if r.results], costs, plot_title(args.k, p.threshold_of[ORACLE]))


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


def _format_plan(p: ReplayPlan) -> str:
    """One line per drafter: its k and when it drafts (what "as the engine would" resolved to)."""
    lines = ["drafting plan (k, and the most running responses at which a round drafts):"]

    def when(name: str) -> str:
        return "every round" if p.threshold_of[name] is None else f"<= {p.threshold_of[name]} running"

    for name in p.drafters:
        lines.append(f"  {name:<14} k={p.k_of[name]:<3} {when(name)}")
    for sources in p.oracles:
        lines.append(f"  {ORACLE:<14} k={p.k_of[ORACLE]:<3} {when(ORACLE)}, sources {'+'.join(sources)} "
                     f"(not a drafter: the best source per step)")
    own = any(s in OWN_SOURCES for sources in p.oracles for s in sources)
    lines.append(f"  SAM policy {p.policy.as_dict()}" + (" (also the oracle's own and group sources)" if own else ""))
    return "\n".join(lines)


def _long_context(args: argparse.Namespace, path: str, groups: list[TraceGroup], names: list[str], k_of: dict[str, int],
                  policy: DraftPolicy) -> list[long_context.LongContextCost]:
    lengths = [int(x) for x in args.long_context.split(",") if x.strip()]
    if not lengths:
        return []
    vocab = vocab_size(groups)
    costs: list[long_context.LongContextCost] = []
    for name in names:
        costs += long_context.measure(factory(name, vocab, policy, suffix=suffix_from_args(args)), groups, lengths,
                                      k_of[name], rows=args.long_context_rows)
    print(f"\nper row-step drafter cost at long context ({args.long_context_rows} rows per step, "
          f"tokens of {path}):")
    print(report.format_long_context(costs))
    return costs

