"""What the HTTP layer costs: the same requests through `samrollout serve` and straight into the engine.

    python bench/http_overhead.py --json bench/results/http-overhead-cpu.json --plot bench/results/http-overhead-cpu.png

Both paths use one engine configuration (the tiny model by default, so that serving
overhead is not hidden behind model compute; SAM on, as served) and the same prompts,
seeds and `max_tokens`: at concurrency 1, 16 and 64 it reports requests/s and the mean
and p50/p99 latency of each path, and the difference (the added latency of HTTP, JSON,
vLLM's OpenAI layer and our RL fields).  The direct path is `AsyncLLM.generate` in this
process; the HTTP path is the `openai`-shaped JSON over httpx against a server subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # server_process: start/stop `samrollout serve`


def _prompts(count: int) -> list[str]:
    return [f"Request {i}: write the numbers from {i} to {i + 50}." for i in range(count)]


def _summary(latencies: list[float], wall: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"requests": len(ordered), "requests_per_s": len(ordered) / wall,
            "mean_ms": 1000 * statistics.fmean(ordered), "p50_ms": 1000 * ordered[len(ordered) // 2],
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


async def _run_concurrently(call: Any, prompts: list[str], concurrency: int) -> dict[str, float]:
    """Issue ``call(prompt)`` for every prompt with at most ``concurrency`` in flight; latency per call."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(prompt: str) -> None:
        async with gate:
            start = time.perf_counter()
            await call(prompt)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return _summary(latencies, time.perf_counter() - start)


async def measure_engine(model: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Requests straight into an in-process AsyncLLM with the server's engine settings."""
    from vllm import SamplingParams

    from samrollout.config import SpeculationConfig
    from samrollout.engine import build_async_engine

    engine = build_async_engine(model, SpeculationConfig(k=3), gpu_memory_utilization=0.3, seed=0,
                                max_model_len=args.max_model_len, dtype="float32", enforce_eager=True)
    counter = 0

    async def call(prompt: str) -> None:
        nonlocal counter
        counter += 1
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        async for _ in engine.generate(prompt, params, request_id=f"bench-{counter}"):
            pass

    try:
        await _run_concurrently(call, _prompts(8), 8)  # warm-up
        return {c: await _run_concurrently(call, _prompts(args.requests), c) for c in args.concurrency}
    finally:
        engine.shutdown()


async def measure_http(url: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """The same requests as JSON over HTTP to `samrollout serve`."""
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def call(prompt: str) -> None:
            body = {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            reply = await client.post("/v1/completions", json=body)
            reply.raise_for_status()

        await _run_concurrently(call, _prompts(8), 8)
        return {c: await _run_concurrently(call, _prompts(args.requests), c) for c in args.concurrency}


def write_plot(result: dict[str, Any], path: str) -> None:
    """Requests/s and mean latency per concurrency, engine vs HTTP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [row["concurrency"] for row in result["rows"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for path_name in ("engine", "http"):
        axes[0].plot(levels, [row[path_name]["requests_per_s"] for row in result["rows"]], marker="o",
                     label=path_name)
        axes[1].plot(levels, [row[path_name]["mean_ms"] for row in result["rows"]], marker="o", label=path_name)
    axes[0].set_title("requests/s")
    axes[1].set_title("mean latency, ms")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.legend()
    fig.suptitle(f"HTTP layer overhead ({result['model_kind']} model, max_tokens={result['max_tokens']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Measure both paths, print the table, write JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot")
    args = parser.parse_args()

    from samrollout.models import build_tiny_model, cache_root, ensure_smollm2
    from server_process import start_server

    model = str(ensure_smollm2() if args.model == "smollm2" else
                build_tiny_model(cache_root() / "models" / "tiny-random-llama", ensure_smollm2()))
    engine = asyncio.run(measure_engine(model, args))
    server = start_server(["--model", model, "--served-model-name", "bench", "--max-model-len",
                           str(args.max_model_len), "--dtype", "float32", "--k", "3", "--log-level", "warning",
                           "--", "--enforce-eager"], Path("/tmp/samrollout-http-overhead.log"))
    try:
        http = asyncio.run(measure_http(server.url, args))
    finally:
        server.stop()

    rows = [{"concurrency": c, "engine": engine[c], "http": http[c],
             "added_mean_ms": http[c]["mean_ms"] - engine[c]["mean_ms"],
             "throughput_ratio": http[c]["requests_per_s"] / engine[c]["requests_per_s"]} for c in args.concurrency]
    print(f"{'conc':>5} {'engine req/s':>13} {'http req/s':>11} {'ratio':>6} {'engine ms':>10} {'http ms':>9} "
          f"{'added ms':>9} {'http p99':>9}")
    for row in rows:
        engine_row, http_row = row["engine"], row["http"]
        print(f"{row['concurrency']:>5} {engine_row['requests_per_s']:>13.1f} {http_row['requests_per_s']:>11.1f} "
              f"{row['throughput_ratio']:>6.2f} {row['engine']['mean_ms']:>10.1f} {row['http']['mean_ms']:>9.1f} "
              f"{row['added_mean_ms']:>9.1f} {row['http']['p99_ms']:>9.1f}")
    result = {"model_kind": args.model, "max_tokens": args.max_tokens, "requests": args.requests, "rows": rows}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.plot:
        write_plot(result, args.plot)


if __name__ == "__main__":
    main()
