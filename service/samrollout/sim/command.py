"""``samrollout simulate``: how much faster will my rollouts be?  Projected rollout time per mode, side by side.

Replays real responses (at their real lengths) as one synchronous rollout per setting through
`samrollout.sim.rollout` with a measured cost table (``bench/results/verify-cost-*.json`` format,
`samrollout.sim.cost`), for each mode:

- ``off``: no speculation;
- ``suffix``: vLLM's SuffixDecoding as the ``--suffix-*`` options set it, vLLM 0.32's defaults unless given
  (global cache of 10,000 requests, depth 24, k = the depth, spec factor 1, min_token_prob 0.1, every step);
  ``suffix-kN``: the same at k = N; ``-dN``: depth N; ``-fN``: spec factor N; ``-nN``: N cached requests;
  ``suffix-nocache``: its global tree off; ``suffix-best``: the fastest of the grid depth {24, 64} x k
  {8, 16, 32} x spec factor {1, 2} with 100,000 cached requests (`samrollout.sim.suffix_best`; every point
  is simulated, the winner reported with its ``setting``);
- ``ngram``: vLLM's n-gram at k 3 (vLLM has no default k); ``ngram-kN``;
- ``samrollout``: ours at the server's defaults for the cost table's device kind (`ServerSettings`: the
  adaptive policy), its step-cost prior as ``--cost-prior`` says; ``@table``, ``@line``, ``@wrong-table``
  or ``@auto`` at the end of a mode name picks ours' prior for that mode (`samrollout.sim.priors`);
  ``samrollout-aN``: its longest draft N; ``samrollout-pN.W``: the N longest-running rows weigh W (critical
  path);
- ``samrollout-static``: ours with the static threshold and its knobs at their defaults for the device kind
  (the server's defaults until the adaptive policy); ``samrollout-static-kN``: N tokens up to the threshold;
  ``-tN``: threshold N; ``-cN``: confident drafts from matches of N+ tokens (0: none past the threshold);
  ``-rB.K-rB.K...``: the draft range, K tokens while at most B run (threshold: the last B); ``-pN.K``:
  critical-path drafting, the N longest-running rows draft up to K tokens (N 0: off);
- on either: ``-sP``: match_scale P/100 (a match of L tokens drafts at most P/100 * L); ``-mN``: min_match_length N;
- a ``+length-aware`` or ``+fcfs`` suffix on any mode: the server's length-aware admission or fcfs
  (default: fcfs for vLLM's modes and off, the server's default scheduling for ours);
- then ``+divided`` (or ``+dividedN``): the client's divided rollout across ``--instances``, a
  response moving after 1024 (N) tokens of its current piece to an instance with room.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from samrollout.config import DEVICE_KINDS, DeviceKind, SpeculationConfig, checked_draft_range
from samrollout.replay.peers import SuffixSettings, add_suffix_flags, suffix_from_args
from samrollout.replay.protocol import ReplayDrafter
from samrollout.replay.traces import (
    TraceError,
    TraceGroup,
    load_traces,
    response_filters,
    select,
    split_paths,
    vocab_size,
)
from samrollout.server.settings import SCHEDULING_POLICIES, SchedulingPolicy
from samrollout.sim import suffix_best
from samrollout.sim.cost import CostTable
from samrollout.sim.priors import COST_PRIORS, prior_path
from samrollout.sim.rollout import SimResult, SimSettings, simulate

DEFAULT_MODES = "off,ngram,suffix,samrollout-static,samrollout,samrollout+fcfs"
_MODE = re.compile(r"^(off|ngram|suffix|suffix-nocache|samrollout-static|samrollout)"
                   r"((?:-[ktcsmadfn]\d+|-[rp]\d+\.\d+)*)"
                   rf"(\+(?:{'|'.join(map(re.escape, SCHEDULING_POLICIES))}))?$")
ModePlan = tuple[str, int, SpeculationConfig | SuffixSettings | None, SchedulingPolicy]
"""A mode's (drafter kind, k, our config, or vLLM suffix's settings, or None, scheduling)."""
_PRIOR = re.compile(rf"@({'|'.join(map(re.escape, COST_PRIORS))})$")
_DIVIDED = re.compile(r"\+divided(\d+)?$")
DIVIDE_AFTER_TOKENS = 1024  # "+divided": the client's divide_after_tokens for the projection


def divided_after(name: str) -> int | None:
    """The ``divide_after_tokens`` a mode name's ``+divided[N]`` suffix asks for (None: not divided)."""
    match = _DIVIDED.search(name)
    if match is None:
        return None
    return int(match.group(1)) if match.group(1) else DIVIDE_AFTER_TOKENS


def add_simulate_parser(commands: Any) -> None:
    """Register the ``simulate`` sub-command."""
    p = commands.add_parser("simulate", help="project rollout time per speculation mode from a cost table",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", action="append", required=True,
                   help="JSONL(.gz) trace files (as for `samrollout replay`); comma-separated or repeated")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer path for text traces")
    p.add_argument("--cost", required=True, help="cost table JSON (bench/verify_cost.py or bench/engine_cost.py)")
    p.add_argument("--device-kind", choices=DEVICE_KINDS,
                   help="whose server defaults 'samrollout' means (default: the cost table's device)")
    p.add_argument("--responses", choices=["all", "clean", "both"], default="clean")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated (default {DEFAULT_MODES})")
    p.add_argument("--slots", default="64", help="max_num_seqs per instance, comma-separated for several runs")
    p.add_argument("--instances", default="1", help="engine instances, comma-separated for several runs")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV cache per instance in tokens (default: unlimited); past it the newest sequence is "
                        "preempted and recomputed, as vLLM does")
    p.add_argument("--history", type=int, default=0, metavar="N",
                   help="each group's first N responses are an earlier rollout (given to drafters that keep "
                        "them: ours, suffix's global cache), not simulated")
    p.add_argument("--max-groups", type=int, help="only the first N groups of each file")
    p.add_argument("--no-drafter-time", action="store_true",
                   help="do not charge the drafters' own CPU time (measured here) to the steps")
    p.add_argument("--drafter-time-scale", type=float, default=1.0,
                   help="charge the drafters' measured CPU time times this (bench/host_speed.py measures this host "
                        "against a reference: its drafter_time_scale)")
    p.add_argument("--json", help="write every result to this JSON file")
    p.add_argument("--plot", help="write a PNG of unfinished responses over time per mode")
    add_mode_flags(p)
    p.set_defaults(run=run)


def device_kind_of(args: argparse.Namespace, cost: CostTable) -> DeviceKind:
    """Whose server defaults ``samrollout`` means: ``--device-kind``, else the cost table's device."""
    if args.device_kind:
        return cast(DeviceKind, args.device_kind)
    return "cuda" if cost.device.startswith("cuda") else "npu" if cost.device.startswith("npu") else "cpu"


def mode_settings(name: str, device_kind: DeviceKind, suffix: SuffixSettings | None = None,
                  cost_prior: str = "auto", cost_path: str | None = None) -> ModePlan:
    """(drafter kind, k, our config or suffix's settings or None, scheduling) of a mode name (ValueError: unknown).
    ``suffix``: a bare ``suffix``'s settings (default vLLM's); ``cost_prior``: ours' (`samrollout.sim.priors`)
    unless the name ends in ``@<prior>``; ``cost_path``: the simulator's table (table, wrong-table)."""
    name, named_prior = _split_prior(name)
    match = _MODE.match(_DIVIDED.sub("", name))
    if match is None:
        raise ValueError(f"unknown mode {name!r}: see `samrollout simulate --help`")
    base, options, order = match.groups()
    scheduling: SchedulingPolicy = cast(SchedulingPolicy, order[1:]) if order else "fcfs"
    parts = [opt for opt in options.split("-") if opt]
    values = {opt[0]: int(opt[1:]) for opt in parts if opt[0] not in "rp"}
    critical = [tuple(int(x) for x in opt[1:].split(".")) for opt in parts if opt[0] == "p"]
    draft_range = tuple((int(a), int(b)) for a, b in (opt[1:].split(".") for opt in parts if opt[0] == "r"))
    if base in ("suffix", "suffix-nocache"):
        return suffix_plan(name, base, values, suffix or SuffixSettings(), scheduling)
    cost_prior = _ours_prior(name, base, values, named_prior, cost_prior)
    if base == "ngram":
        return base, values.get("k", SpeculationConfig.k), None, scheduling
    if base == "off":
        return base, 1, None, scheduling
    from samrollout.server.settings import ServerSettings

    server = ServerSettings.model_validate({"threshold_mode": "static"} if base == "samrollout-static" else {})
    config = server.speculation_config(device_kind)
    assert config is not None
    config = _with_prior(config, cost_prior, cost_path, device_kind)
    scheduling = cast(SchedulingPolicy, order[1:]) if order else server.rollout_scheduling
    options_of = _adaptive_options if config.threshold_mode == "adaptive" else _static_options
    config = options_of(name, config, values, critical, draft_range)
    return base, config.largest_draft(), config, scheduling


def _with_match_options(config: SpeculationConfig, values: dict[str, int]) -> SpeculationConfig:
    """A config with a mode name's ``-sN`` (match scale, percent) and ``-mN`` (shortest match) applied."""
    if "s" not in values and "m" not in values:
        return config
    return replace(config, policy=replace(
        config.policy, match_scale=values.get("s", round(config.policy.match_scale * 100)) / 100,
        min_match_length=values.get("m", config.policy.min_match_length)))


def _adaptive_options(name: str, config: SpeculationConfig, values: dict[str, int],
                      critical: list[tuple[int, ...]], draft_range: tuple[tuple[int, int], ...]) -> SpeculationConfig:
    """The adaptive policy's config with a mode name's options (ValueError: a static mode's option)."""
    if "a" in values:
        config = replace(config, max_draft=values["a"])
    if critical:
        config = replace(config, critical_rows=critical[-1][0], critical_weight=float(critical[-1][1]))
    unused = sorted(set(values) - {"a", "s", "m"}) + (["r"] if draft_range else [])
    if unused:
        raise ValueError(f"mode {name!r}: options {unused} are the static mode's: use samrollout-static-...")
    return _with_match_options(config, values)


def _static_options(name: str, config: SpeculationConfig, values: dict[str, int],
                    critical: list[tuple[int, ...]], draft_range: tuple[tuple[int, int], ...]) -> SpeculationConfig:
    """The static gate's config with a mode name's options (ValueError: the adaptive policy's ``-aN``)."""
    if "t" in values:
        config = replace(config, threshold=values["t"],
                         draft_range=None if config.draft_range is None else
                         ((values["t"], max(k for _, k in config.draft_range)),))
    if "k" in values:
        config = replace(config, draft_range=((config.threshold, values["k"]),))
    if draft_range:
        config = replace(config, threshold=draft_range[-1][0], draft_range=checked_draft_range(draft_range))
    config = _with_match_options(config, values)
    if "c" in values:
        config = replace(config, confident_match=values["c"])
    if critical:
        config = replace(config, critical_rows=critical[-1][0], critical_k=critical[-1][1])
    if "a" in values:
        raise ValueError(f"mode {name!r}: -aN (longest draft) is the adaptive policy's: use samrollout-aN")
    return config


def _split_prior(name: str) -> tuple[str, str | None]:
    """A mode name without its ``@<prior>`` suffix, and that prior (None: none named)."""
    match = _PRIOR.search(name)
    return (name, None) if match is None else (name[:match.start()], match.group(1))


def _ours_prior(name: str, base: str, values: dict[str, int], named: str | None, default: str) -> str:
    """The prior a mode of ours (or off, ngram) runs with; ValueError for suffix's options on them."""
    if "d" in values or "f" in values or "n" in values:
        raise ValueError(f"mode {name!r}: -dN, -fN and -nN are suffix's (depth, spec factor, cached requests)")
    if named is not None and not base.startswith("samrollout"):
        raise ValueError(f"mode {name!r}: @prior is ours' (the adaptive policy's step-cost prior)")
    return default if named is None else named


def _with_prior(config: SpeculationConfig, cost_prior: str, cost_path: str | None,
                device_kind: DeviceKind) -> SpeculationConfig:
    """Ours' config with the step-cost prior a prior name means (`samrollout.sim.priors`; auto: as it is)."""
    if cost_prior == "auto":
        return config
    if cost_path is None and cost_prior != "line":
        raise ValueError(f"cost prior {cost_prior!r} needs the simulator's cost table")
    return replace(config, cost_prior=prior_path(cost_prior, cost_path or "", device_kind))


def suffix_plan(name: str, base: str, values: dict[str, int], suffix: SuffixSettings,
                scheduling: SchedulingPolicy) -> ModePlan:
    """vLLM `suffix`'s plan: ``suffix``'s settings with the name's ``-dN`` (depth), ``-kN``, ``-fN`` (spec
    factor) and ``-nN`` (cached requests) applied; k, when neither names it, the depth (as vLLM sets it)."""
    unused = sorted(set(values) - {"d", "k", "f", "n"})
    if unused:
        raise ValueError(f"mode {name!r}: options {unused} are not suffix's (-dN depth, -kN, -fN spec factor, "
                         f"-nN cached requests)")
    depth = values.get("d", suffix.depth)
    k = values.get("k", suffix.k if "d" not in values else None)
    settings = replace(suffix, depth=depth, k=k, spec_factor=float(values.get("f", suffix.spec_factor)),
                       cached_requests=values.get("n", suffix.cached_requests))
    return base, settings.num_speculative_tokens, settings, scheduling


def drafter_factory(kind: str, vocab: int, config: SpeculationConfig | SuffixSettings | None,
                    device_kind: DeviceKind) -> Callable[[], ReplayDrafter] | None:
    """A fresh drafter per instance for a mode (None: no speculation)."""
    if kind == "off":
        return None
    if kind.startswith("samrollout"):
        from samrollout.replay.drafters import SamReplayDrafter

        assert isinstance(config, SpeculationConfig)
        ours = config
        return lambda: SamReplayDrafter.as_engine("samrollout", vocab, ours, on_cpu=device_kind == "cpu")
    from samrollout.replay.registry import make_drafter

    name = {"suffix": "suffix-cache", "suffix-nocache": "suffix", "ngram": "ngram"}[kind]
    suffix = config if isinstance(config, SuffixSettings) else None
    return lambda: make_drafter(name, vocab, suffix=suffix)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    """Simulate every mode for every file, response filter, slot count and instance count; print, write, plot."""
    from samrollout.replay.command import split_history

    try:
        cost = CostTable.load(args.cost)
        device_kind = device_kind_of(args, cost)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        plans = mode_plans(args, modes, device_kind)
        files = {path: load_traces(path, args.tokenizer, args.max_groups) for path in split_paths(args.traces)}
    except (TraceError, ValueError, OSError) as error:
        print(f"samrollout simulate: {error}", file=sys.stderr)
        return 2
    filters = response_filters(args.responses)
    projections: list[dict[str, Any]] = []
    for path, loaded in files.items():
        vocab = vocab_size(loaded)
        for which in filters:
            groups, earlier = split_history(select(loaded, which, []), args.history)
            for slots in _ints(args.slots):
                for instances in _ints(args.instances):
                    settings = SimSettings(slots=slots, kv_tokens=args.kv_tokens, instances=instances,
                                           charge_drafter=not args.no_drafter_time,
                                           drafter_time_scale=args.drafter_time_scale)
                    projections.append(project(path, which, groups, earlier, settings, plans, vocab, cost,
                                               device_kind, bests=[m for m in modes if is_best(m)]))
                    write_report(args, cost, device_kind, projections)  # after each projection: a long run keeps them
    if args.plot:
        write_plot(args.plot, projections)
    return 0


def is_best(mode: str) -> bool:
    """Whether a mode name is ``suffix-best[+scheduling]`` (the grid's best, `samrollout.sim.suffix_best`)."""
    return mode.split("+")[0] == suffix_best.BEST


def mode_plans(args: argparse.Namespace, modes: list[str], device_kind: DeviceKind) -> dict[str, ModePlan]:
    """Every mode's plan, ``suffix-best`` expanded into its grid, the ``--suffix-*`` and ``--cost-prior``
    options applied (ValueError names a bad mode or setting)."""
    suffix = suffix_from_args(args)
    return {m: mode_settings(m, device_kind, suffix, args.cost_prior, args.cost) for m in suffix_best.expand(modes)}


def add_mode_flags(p: Any) -> None:
    """The options that say what the modes mean: vLLM suffix's settings and ours' step-cost prior."""
    add_suffix_flags(p)
    p.add_argument("--cost-prior", choices=COST_PRIORS, default="auto",
                   help="ours' step-cost prior: auto (the server's default for the device kind), table (the "
                        "simulator's own table: the prior is the truth), line (the generic line a device with "
                        "no table gets), wrong-table (the table with draft tokens 2x costlier); a mode's "
                        "@<prior> suffix overrides it (default auto)")


def write_report(args: argparse.Namespace, cost: CostTable, device_kind: DeviceKind,
                 projections: list[dict[str, Any]]) -> None:
    """The JSON report of the projections so far, with the command's options (when --json is given)."""
    if not args.json:
        return
    report = {"cost_table": cost.describe(), "device_kind": device_kind, "projections": projections,
              "options": {key: value for key, value in vars(args).items() if key != "run"}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def project(path: str, which: str, groups: list[TraceGroup], earlier: list[Any], settings: SimSettings,
            plans: dict[str, ModePlan], vocab: int, cost: CostTable,
            device_kind: DeviceKind, bests: list[str] | None = None) -> dict[str, Any]:
    """One projection (a file, filter, slots and instances): every mode simulated, printed as a table;
    each of ``bests`` (``suffix-best[+scheduling]``) reported as its grid's shortest makespan, with its setting."""
    results: dict[str, SimResult] = {}
    seconds: dict[str, float] = {}
    for mode, (kind, k, config, scheduling) in plans.items():
        started = time.perf_counter()
        results[mode] = simulate(groups, drafter_factory(kind, vocab, config, device_kind), k, cost,
                                 replace(settings, scheduling=scheduling, divide_after_tokens=divided_after(mode)),
                                 mode, earlier)
        seconds[mode] = time.perf_counter() - started
    plans = dict(plans)
    winners: dict[str, str] = {}
    for name in bests or []:
        winners[name] = suffix_best.best(suffix_best.grid_of(name, results), lambda m: -results[m].makespan_s)
        results[name], plans[name], seconds[name] = results[winners[name]], plans[winners[name]], 0.0
    responses = sum(len(g.responses) for g in groups)
    print(f"\n== {path} ({which}: {responses} responses in {len(groups)} groups), {settings.slots} slots x "
          f"{settings.instances} instance(s), KV {settings.kv_tokens or 'unlimited'} tokens")
    print(format_table(results))
    return {"traces": path, "responses": which, "slots": settings.slots, "instances": settings.instances,
            "kv_tokens": settings.kv_tokens, "response_count": responses, "groups": len(groups),
            "modes": {mode: {**result.as_dict(), "k": plans[mode][1], "scheduling": plans[mode][3],
                             "config": _config_json(plans[mode][2]), "simulation_wall_s": seconds[mode],
                             **({"setting": winners[mode]} if mode in winners else {})}
                      for mode, result in results.items()}}


def _config_json(config: SpeculationConfig | SuffixSettings | None) -> dict[str, Any] | None:
    return None if config is None else config.to_json()


def format_table(results: dict[str, SimResult]) -> str:
    """Makespan (and against off and vLLM suffix), tail, steps, tokens/s, MAL, drafter time per mode."""
    off = results.get("off")
    suffix = results.get("suffix")
    lines = [f"{'mode':<32}{'makespan s':>11}{'x off':>7}{'x suffix':>9}{'tail s':>8}{'steps':>8}"
             f"{'tok/s':>9}{'MAL':>6}{'drafter s':>10}{'preempt':>8}"]
    for mode, r in results.items():
        vs_off = r.makespan_s / off.makespan_s if off and off.makespan_s else float("nan")
        vs_suffix = r.makespan_s / suffix.makespan_s if suffix and suffix.makespan_s else float("nan")
        lines.append(f"{mode:<32}{r.makespan_s:>11.1f}{vs_off:>7.2f}{vs_suffix:>9.2f}{r.tail_s:>8.1f}{r.steps:>8}"
                     f"{r.tokens / r.makespan_s if r.makespan_s else 0:>9.0f}{r.mean_acceptance_length:>6.2f}"
                     f"{r.drafter_s:>10.2f}{r.preemptions:>8}")
    return "\n".join(lines)


def write_plot(path: str, projections: list[dict[str, Any]]) -> None:
    """Unfinished responses over time, one line per mode, one panel per projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(projections)
    columns = min(count, 2)
    rows = (count + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4 * rows), squeeze=False)
    for ax, projection in zip(axes.flat, projections, strict=False):
        for mode, data in projection["modes"].items():
            points = data["timeline"]
            ax.step([p[0] for p in points], [p[1] for p in points], where="post",
                    label=f"{mode} ({data['makespan_s']:.0f} s)")
        ax.set_title(f"{Path(projection['traces']).name.split('.')[0]} {projection['responses']}, "
                     f"{projection['slots']} slots x {projection['instances']}", fontsize=9)
        ax.set_xlabel("simulated seconds")
        ax.set_ylabel("responses unfinished")
        ax.set_yscale("symlog", linthresh=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
