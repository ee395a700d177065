"""``samrollout simulate-rl``: what a trainer gets from N servers over S steps, synchronous or asynchronous.

Projects samples per second delivered to the trainer for each loop (`samrollout.sim.rl_loop`: ``sync``
with ``wait``, ``sync-abort`` with over-sampling, ``async`` partial rollouts with ``continue`` and a
staleness bound) and each drafter (``off``, vLLM ``suffix``, ``samrollout``, any mode `samrollout simulate`
knows), on the instances and slots given, under each placement (``affine``, ``least-outstanding``), with
the training time as seconds or as a ratio of the sync + off rollout time, and every weight update
charged for its transfer, pause and KV recompute.

The prompt set is every group of the trace files; ``--epochs`` splits each group's responses into that
many successive epochs, so a prompt's later epochs draft from its earlier responses only where those ran
on the same instance (history is never a copy, and never the response itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from samrollout.config import DEVICE_KINDS, DeviceKind
from samrollout.replay.traces import (
    TraceError,
    TraceGroup,
    load_traces,
    response_filters,
    select,
    split_paths,
    vocab_size,
)
from samrollout.sim import suffix_best
from samrollout.sim.command import (
    ModePlan,
    add_mode_flags,
    device_kind_of,
    drafter_factory,
    is_best,
    mode_plans,
    write_report,
)
from samrollout.sim.cost import CostTable
from samrollout.sim.rl_loop import (
    SIM_PLACEMENTS,
    WEIGHT_TRANSFERS,
    LoopGroup,
    LoopSettings,
    UpdateCosts,
    epoch_stream,
    groups_sent,
    simulate_loop,
)
from samrollout.sim.rollout import simulate
from samrollout.sim.state import SimSettings
from samrollout_client.rollout_rules import DEFAULT_MAX_STALENESS, LOOP_SHORT_NAMES, concurrent_groups

MODE_PREFIX: dict[str, str] = {loop: name for name, loop in LOOP_SHORT_NAMES.items()}
DEFAULT_LOOPS = "sync,async"
DEFAULT_DRAFTERS = "off,suffix,samrollout"


def add_simulate_rl_parser(commands: Any) -> None:
    """Register the ``simulate-rl`` sub-command."""
    p = commands.add_parser("simulate-rl", help="project trainer samples/s of an RL loop over several servers",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", action="append", required=True, help="JSONL(.gz) trace files, as for `simulate`")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer path for text traces")
    p.add_argument("--cost", required=True, help="cost table JSON (bench/verify_cost.py or bench/engine_cost.py)")
    p.add_argument("--device-kind", choices=DEVICE_KINDS,
                   help="whose server defaults 'samrollout' means (default: the cost table's device)")
    p.add_argument("--responses", choices=["all", "clean", "both"], default="clean")
    p.add_argument("--max-groups", type=int, help="only the first N groups of each file")
    p.add_argument("--epochs", type=int, default=2, help="each group's responses split into this many epochs")
    p.add_argument("--loops", default=DEFAULT_LOOPS, help=f"of {', '.join(LOOP_SHORT_NAMES)} (default {DEFAULT_LOOPS})")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                   help=f"modes as `samrollout simulate --modes` names them (default {DEFAULT_DRAFTERS})")
    p.add_argument("--placements", default="affine,least-outstanding", help=f"of {', '.join(SIM_PLACEMENTS)}")
    p.add_argument("--instances", default="2", help="engine instances, comma-separated for several runs")
    p.add_argument("--slots", default="64", help="max_num_seqs per instance, comma-separated")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV cache per instance in tokens (default: unlimited)")
    p.add_argument("--batch-groups", type=int, default=None,
                   help="groups per trainer step (default: the prompts of one epoch)")
    p.add_argument("--steps", type=int, default=None,
                   help="trainer steps (default: as many as the stream holds, one batch kept back for async)")
    p.add_argument("--train-ratio", default="0",
                   help="training time per step as a ratio of the sync + off (fcfs) rollout time on the first "
                        "placement, comma-separated (one trainer for every placement and mode)")
    p.add_argument("--train-s", type=float, default=None, help="training time per step in seconds (instead)")
    p.add_argument("--max-staleness", default=str(DEFAULT_MAX_STALENESS),
                   help="async staleness bounds, comma-separated ('none': no bound; default: the client's)")
    p.add_argument("--oversample", type=float, default=0.5, help="sync-abort: extra groups, as a fraction")
    p.add_argument("--max-concurrent-groups", type=int, default=None, help="async: groups held (default two batches)")
    p.add_argument("--checkpoint-gb", type=float, default=16.0, help="checkpoint size in GB (Qwen3-8B in bf16: 16)")
    p.add_argument("--weights", default="shared-disk", help=f"of {', '.join(WEIGHT_TRANSFERS)}, comma-separated")
    p.add_argument("--link-gbit", type=float, default=25.0, help="the trainer's push link, Gb/s")
    p.add_argument("--disk-gbyte-s", type=float, default=2.0, help="a server's shared-disk read, GB/s")
    p.add_argument("--load-gbyte-s", type=float, default=10.0, help="a server's load of pushed (staged) files, GB/s")
    p.add_argument("--kv", choices=["recompute", "keep"], default="recompute",
                   help="continue updates: recompute the KV of the tokens in flight, or keep it")
    p.add_argument("--drafter-time-scale", default="1",
                   help="charge the drafters' measured CPU time times this, comma-separated (0: not charged; 0.5: a "
                        "CPU twice as fast; bench/host_speed.py measures this host against a reference)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="simulations run side by side, one process each (default: one per CPU)")
    p.add_argument("--seeds", default="0",
                   help="stream orders, comma-separated: seed 0 visits the prompts in file order in the first epoch, "
                        "a seed N > 0 in an order of its own; later epochs reshuffle by the seed (default 0)")
    p.add_argument("--json", help="write every projection to this JSON file")
    add_mode_flags(p)
    p.set_defaults(run=run)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _staleness(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def run(args: argparse.Namespace) -> int:
    """Every file x response filter x instances x slots x weights x drafter-time scale: print and write."""
    try:
        cost = CostTable.load(args.cost)
        device_kind = device_kind_of(args, cost)
        drafters = mode_plans(args, [m for m in _split(args.drafters) if not is_best(m)], device_kind)
        bests = [m for m in _split(args.drafters) if is_best(m)]
        grid = mode_plans(args, bests, device_kind)
        loops: list[str] = [LOOP_SHORT_NAMES[name] for name in _split(args.loops)]
        placements = _split(args.placements)
        transfers = _split(args.weights)
        for value, allowed, what in ((placements, SIM_PLACEMENTS, "placement"), (transfers, WEIGHT_TRANSFERS,
                                                                                   "weights")):
            unknown = set(value) - set(allowed)
            if unknown:
                raise ValueError(f"unknown {what} {sorted(unknown)}: choose from {', '.join(allowed)}")
        files = {path: load_traces(path, args.tokenizer, args.max_groups) for path in split_paths(args.traces)}
    except KeyError as error:
        print(f"samrollout simulate-rl: unknown loop {error}: choose from {', '.join(LOOP_SHORT_NAMES)}",
              file=sys.stderr)
        return 2
    except (TraceError, ValueError, OSError) as error:
        print(f"samrollout simulate-rl: {error}", file=sys.stderr)
        return 2
    filters = response_filters(args.responses)
    projections: list[dict[str, Any]] = []
    for path, loaded in files.items():
        for which in filters:
            for seed in map(int, _split(args.seeds)):
                groups = _ordered(select(loaded, which, []), seed)
                stream = epoch_stream(groups, args.epochs, shuffle_seed=seed)
                for instances, slots, transfer, scale in product(map(int, _split(args.instances)),
                                                                 map(int, _split(args.slots)), transfers,
                                                                 map(float, _split(args.drafter_time_scale))):
                    sim = SimSettings(slots=slots, kv_tokens=args.kv_tokens, instances=instances,
                                      charge_drafter=scale > 0, drafter_time_scale=scale)
                    updates = UpdateCosts(checkpoint_bytes=args.checkpoint_gb * 1e9, transfer=transfer,  # type: ignore[arg-type]
                                          link_gbit_s=args.link_gbit, disk_gbyte_s=args.disk_gbyte_s,
                                          load_gbyte_s=args.load_gbyte_s, kv=args.kv)
                    shape = {"traces": path, "responses": which, "instances": instances, "slots": slots,
                             "weights": transfer, "drafter_time_scale": scale, "epochs": args.epochs,
                             "prompts": len(groups), "stream_groups": len(stream), "seed": seed,
                             "cost_prior": args.cost_prior}
                    vocab = vocab_size(loaded)
                    picked = pick_best(args, bests, grid, stream, sim, vocab, cost, device_kind)
                    shape["suffix_best"] = {name: choice for name, (choice, _) in picked.items()}
                    plans = {**drafters, **{name: plan for name, (_, plan) in picked.items()}}
                    projections += project(args, shape, stream, sim, updates, loops, plans, placements,
                                           vocab, cost, device_kind)
                    write_report(args, cost, device_kind, projections)
    return 0


def _ordered(groups: list[TraceGroup], seed: int) -> list[TraceGroup]:
    """The prompts in the order stream ``seed`` visits them first: the file's (seed 0) or a seeded permutation."""
    if seed == 0:
        return groups
    order = np.random.default_rng(1000 + seed).permutation(len(groups))
    return [groups[i] for i in order]


def pick_best(args: argparse.Namespace, bests: list[str], grid: dict[str, ModePlan], stream: list[LoopGroup],
              sim: SimSettings, vocab: int, cost: CostTable, device_kind: DeviceKind
              ) -> dict[str, tuple[dict[str, Any], ModePlan]]:
    """Each ``suffix-best[+scheduling]``'s winner, picked in the cheaper mode: one synchronous rollout
    (`samrollout simulate`) of the stream's first two trainer steps' groups, on the projection's
    instances and slots, drafter time not charged, for every point of the grid (`samrollout.sim.suffix_best`);
    the highest tokens/s wins.  Returns per name the choice (setting, tokens/s per point) and the winner's plan."""
    batch = args.batch_groups or len({g.prompt_index for g in stream})
    first = [TraceGroup(f"{g.prompt_index}/{g.epoch}", g.prompt, list(g.responses)) for g in stream[:2 * batch]]
    quick = replace(sim, charge_drafter=False)
    out: dict[str, tuple[dict[str, Any], ModePlan]] = {}
    for name in bests:
        modes = suffix_best.grid_of(name, grid)
        tasks = [(first, grid[mode], mode, quick, vocab, cost, device_kind) for mode in modes]
        if args.jobs > 1:
            with ProcessPoolExecutor(max_workers=min(args.jobs, len(tasks))) as pool:
                rates = dict(zip(modes, pool.map(_quick_rate, tasks), strict=True))
        else:
            rates = dict(zip(modes, map(_quick_rate, tasks), strict=True))
        winner = suffix_best.best(rates, rates.__getitem__)
        config = grid[winner][2]
        out[name] = ({"mode": winner, "setting": config.to_json() if config is not None else None,
                      "picked_by": f"one synchronous rollout of the stream's first {len(first)} groups (two "
                                   f"trainer steps), drafter time not charged: tokens/s", "tokens_per_s": rates},
                     grid[winner])
        print(f"{name}: {winner} ({rates[winner]:.0f} tok/s in the quick rollout)", flush=True)
    return out


def _quick_rate(task: tuple[list[TraceGroup], ModePlan, str, SimSettings, int, CostTable, DeviceKind]) -> float:
    """One grid point's tokens/s in `pick_best`'s quick rollout (picklable: it runs in a worker process)."""
    groups, (kind, k, config, scheduling), mode, sim, vocab, cost, device_kind = task
    result = simulate(groups, drafter_factory(kind, vocab, config, device_kind), k, cost,
                      replace(sim, scheduling=scheduling), mode)
    return result.tokens / result.makespan_s if result.makespan_s else 0.0


@dataclass(frozen=True)
class _Task:
    """One loop of one drafter to simulate (picklable: it runs in a worker process)."""

    name: str
    stream: list[LoopGroup]
    plan: ModePlan
    loop: LoopSettings
    sim: SimSettings
    vocab: int
    cost: CostTable
    device_kind: DeviceKind


def _run_task(task: _Task) -> dict[str, Any]:
    """One mode's loop simulated: its report, with the simulation's own wall time."""
    kind, k, config, scheduling = task.plan
    started = time.perf_counter()
    result = simulate_loop(task.stream, drafter_factory(kind, task.vocab, config, task.device_kind), k, task.cost,
                           replace(task.sim, scheduling=scheduling), task.loop, task.name)
    return {**result.as_dict(), "k": k, "scheduling": scheduling, "simulation_wall_s": time.perf_counter() - started}


def _simulation_weight(kind: str) -> int:
    """How long a drafter's simulation takes, relative to the others: the replayed vLLM `suffix` drafter
    (a global cache over every response) is most of a run's time, the engine without drafts the least."""
    return 0 if kind == "off" else 1 if kind.startswith("samrollout") else 2


def _longest_first(tasks: list[_Task]) -> list[int]:
    """Task indices, the slowest to simulate first (longest-processing-time order: no worker is left
    with a `suffix` simulation after the others have run dry)."""
    def weight(index: int) -> tuple[int, int]:
        task = tasks[index]
        return (_simulation_weight(task.plan[0]), task.loop.steps)
    return sorted(range(len(tasks)), key=weight, reverse=True)


def _run_all(tasks: list[_Task], jobs: int) -> list[dict[str, Any]]:
    """Every task's report, in the tasks' order; ``jobs`` worker processes (1: in this one), fed the
    slowest simulations first."""
    if jobs <= 1 or len(tasks) <= 1:
        return [_run_task(task) for task in tasks]
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
        futures = {index: pool.submit(_run_task, tasks[index]) for index in _longest_first(tasks)}
        return [futures[index].result() for index in range(len(tasks))]


def project(args: argparse.Namespace, shape: dict[str, Any], stream: list[LoopGroup], sim: SimSettings,
            updates: UpdateCosts, loops: list[str], drafters: dict[str, ModePlan], placements: list[str], vocab: int,
            cost: CostTable, device_kind: DeviceKind) -> list[dict[str, Any]]:
    """One shape under every placement, training time and staleness bound: a projection each, printed.

    One trainer for the whole shape: ``--train-ratio`` is a ratio of the synchronous step's rollout time of
    sync + off under fcfs on the first placement, and that training time, in seconds, is every placement's and
    every mode's.  Then every loop and drafter, ``--jobs`` at a time.  The sync loops do not depend on the
    staleness bound: each runs once per placement and training time."""
    batch = args.batch_groups or shape["prompts"]
    ratios: list[float | None] = [None] if args.train_s is not None else [float(r) for r in _split(args.train_ratio)]
    bounds = [_staleness(text) for text in _split(args.max_staleness)]
    bases = {placement: LoopSettings(loop="sync-wait", steps=0, batch_groups=batch, placement=placement,  # type: ignore[arg-type]
                                     oversample=args.oversample, max_concurrent_groups=args.max_concurrent_groups,
                                     updates=updates) for placement in placements}
    reference = bases[placements[0]]
    sync_off_s = 0.0
    if any(ratios):
        off: ModePlan = ("off", 1, None, "fcfs")
        report = _run_all([_Task("sync-off", stream, off, replace(reference, train_s=0.0, steps=_steps(
            args, stream, batch, "sync-wait")), sim, vocab, cost, device_kind)], args.jobs)[0]
        sync_off_s = statistics.mean(report["step_rollout_s"]) if report["step_rollout_s"] else 0.0
    keys: list[tuple[str, float | None, int | None, str]] = []
    tasks: list[_Task] = []
    for placement, base in bases.items():
        for ratio in ratios:
            train_s = args.train_s if ratio is None else ratio * sync_off_s
            for loop in loops:
                for bound in bounds if loop == "async-continue" else [None]:
                    for drafter, plan in drafters.items():
                        name = f"{MODE_PREFIX[loop]}-{drafter}"
                        keys.append((placement, ratio, bound, name))
                        tasks.append(_Task(name, stream, plan, replace(base, loop=loop, train_s=train_s,  # type: ignore[arg-type]
                                                                       max_staleness=bound, steps=_steps(
                                                                           args, stream, batch, loop)),
                                           sim, vocab, cost, device_kind))
    reports = dict(zip(keys, _run_all(tasks, args.jobs), strict=True))
    out: list[dict[str, Any]] = []
    for placement in placements:
        for ratio in ratios:
            train_s = args.train_s if ratio is None else ratio * sync_off_s
            for bound in bounds:
                modes = {name: report for (p, r, b, name), report in reports.items()
                         if p == placement and r == ratio and (b == bound or not name.startswith("async"))}
                projection = {**shape, "placement": placement, "batch_groups": batch,
                              "max_concurrent_groups": concurrent_groups(batch, args.max_concurrent_groups or None),
                              "train_ratio": ratio, "train_s": train_s, "train_reference":
                              f"sync + off (fcfs), {placements[0]} placement: {sync_off_s:.1f} s per step's rollout",
                              "sync_off_rollout_s": sync_off_s, "staleness": bound, "modes": modes}
                print(format_projection(projection), flush=True)
                out.append(projection)
    return out


def _steps(args: argparse.Namespace, stream: list[LoopGroup], batch: int, loop: str) -> int:
    """The steps asked for, or as many as the stream holds: an asynchronous loop holds its concurrent groups,
    and the stream must still refill them after every step but the last."""
    if args.steps is not None:
        return int(args.steps)
    if loop == "sync-abort":
        return max(1, len(stream) // groups_sent(LoopSettings(loop="sync-abort", steps=0, batch_groups=batch,
                                                              oversample=args.oversample)))
    if loop == "async-continue":
        held = concurrent_groups(batch, args.max_concurrent_groups or None)
        return max(1, (len(stream) - held) // batch + 1)
    return max(1, len(stream) // batch)


def format_projection(projection: dict[str, Any]) -> str:
    """A table: delivered tokens/s and samples/s, whole run and steady state, staleness, updates, history hits."""
    modes = projection["modes"]
    lines = [f"\n== {Path(projection['traces']).name} ({projection['responses']}), {projection['instances']} x "
             f"{projection['slots']} slots, {projection['placement']}, batch {projection['batch_groups']} groups "
             f"({projection['max_concurrent_groups']} held async), train {projection['train_s']:.1f} s (ratio "
             f"{projection['train_ratio']}), staleness {projection['staleness']}, weights {projection['weights']}, "
             f"drafter time x{projection['drafter_time_scale']}",
             f"{'mode':<30}{'tok/s':>8}{'steady':>8}{'samp/s':>8}{'steady':>8}{'mean len':>9}{'steps':>6}"
             f"{'wall s':>8}{'discard':>9}{'hit':>5}{'MAL':>6}{'drafter s':>10}"]
    for name, m in modes.items():
        lines.append(f"{name:<30}{m['tokens_per_s']:>8.1f}{m['steady']['tokens_per_s']:>8.1f}"
                     f"{m['samples_per_s']:>8.4f}{m['steady']['samples_per_s']:>8.4f}{m['mean_length']:>9.0f}"
                     f"{len(m['step_end_s']):>6}{m['wall_s']:>8.0f}{m['discarded_tokens']:>9}"
                     f"{m['history_hit_rate']:>5.2f}{m['mean_acceptance_length']:>6.2f}{m['drafter_s']:>10.1f}")
    return "\n".join(lines)
