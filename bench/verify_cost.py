"""What verifying k drafts costs the target model, and the break-even acceptance length per batch size.

    python bench/verify_cost.py --device cpu --threads 1 --mal 2.1,2.2 --ks 1,2,3,4,8,12,16 \\
        --json bench/results/verify-cost-cpu-k16.json --plot bench/results/verify-cost-cpu-k16.png
    python bench/verify_cost.py --model qwen3-8b --budget-s 330 --mal 2.1,2.2 \\
        --json bench/results/verify-cost-h100.json --plot bench/results/verify-cost-h100.png
    python bench/verify_cost.py --model qwen3-8b --batches 1,2,4,8,16,32,64,128,256 \\
        --lengths 1024,4096,8192,16384,32768 --ks 1,2,3,4,8,16,24 --warmup 4 --repeats 15 --budget-s 330 \\
        --json bench/results/verify-cost-h100-k24.json --plot bench/results/verify-cost-h100-k24.png
    python bench/verify_cost.py --device npu ...   # Ascend, through torch_npu: written for it, untested here

The JSON it writes is also a cost table for the rollout simulator (`samrollout simulate --cost`,
`samrollout.sim.cost`: the format and the interpolation rule are documented there).

A decode step that verifies k drafts runs the target model over k+1 positions per request instead of
one.  If that step costs r = t(q=k+1) / t(q=1) plain steps, speculation pays exactly when a
verification yields more than r tokens on average (accepted drafts plus the bonus token): r is the
break-even mean acceptance length (MAL), and a measured MAL projects a speedup of MAL / r.  While a
step is memory-bound (small batches: the weights and the KV cache are read once whatever q is) r
stays near 1; as the batch grows the step turns compute-bound and r climbs towards k+1.  So the
break-even MAL is a function of the batch size, which is what this measures, per model shape and
context length L, with plain PyTorch + transformers (no vLLM) so that it runs on any GPU machine.

How a point (model, L, B, q) is measured:

* The model is built from a config with random weights (presets below, shapes of the real
  models), bf16 on CUDA and float32 on CPU.
* The KV cache holds L tokens: one prefill of L random tokens per L (batch 1), copied into every
  row of the batch-B cache (attention time does not depend on the cached values).
* ``--cache static`` (default): transformers' StaticCache, written in place at positions
  L..L+q-1 and rewound to L after every step, like vLLM's paged cache.  ``--cache dynamic``:
  DynamicCache and ``crop`` back to L after every step; its torch.cat copies the whole cache on
  every step, a cost vLLM does not pay, and it cannot be captured in a CUDA graph.
* Attention (the default ``--attn``) reads exactly the L+q cached keys with the query heads of each
  GQA group packed into one kernel call (FlashAttention's pack_gqa, as in vLLM's kernels), the
  same kernel for q = 1 and q = k+1, and no mask: the q verified positions see each other (not
  causal), which changes attention FLOPs by less than q/(2L).  Stock transformers SDPA
  (``--attn sdpa``, for comparison) builds a mask and then repeats K/V per query head (with a
  dynamic cache only when q > 1); unpacked GQA SDPA, left to its default dispatch on an H100,
  runs q > 1 through cuDNN 2-3x slower than q = 1 at L = 8192.  vLLM has neither artefact.
* On CUDA each step is captured once in a CUDA graph and replayed (vLLM also replays decode steps
  from CUDA graphs).  Eager steps (``--no-cuda-graphs``, ``--cache dynamic``) are bound by Python
  launch overhead (about 45 ms a step for qwen3-8b on an H100, against 10-26 ms replayed), which
  flattens the ratios to noise around 1: use them only to see that.
* Timing by CUDA events, on CPU by perf_counter: warm-up, then N rounds that each run every q
  once (interference hits all q alike), and the median per q.

Not counted: the drafter, rejection sampling, and the scheduler; the kernels are PyTorch's, not
vLLM's, so absolute times differ from a vLLM server, the ratios less so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

with contextlib.suppress(ImportError):  # Ascend NPUs: torch_npu registers the "npu" device (--device npu)
    import torch_npu  # type: ignore[import-not-found]  # noqa: F401
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    StaticCache,
)
from transformers import __version__ as transformers_version

from plotting import save, subplots

PRESETS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "smollm2-135m": (LlamaConfig, {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                                   "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                                   "tie_word_embeddings": True}),
    "qwen3-1.7b": (Qwen3Config, {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
                                 "vocab_size": 151936, "tie_word_embeddings": True}),
    "qwen3-8b": (Qwen3Config, {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
                               "vocab_size": 151936, "tie_word_embeddings": False}),
}
ATTN_NAME = "verify_gqa_sdpa"
PACKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

Step = Callable[[], object]


def gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of q new positions over the first ``verify_kv_len`` cached keys, GQA groups packed.

    For a decode/verify step the G query heads sharing a KV head are folded into the query length,
    (B, H, q, D) -> (B, H_kv, G*q, D), and attend without a mask: one read of each KV head serves
    all of its G*q queries (FlashAttention's pack_gqa, as vLLM's kernels do), the same kernel for
    q = 1 and q = k+1.  cuDNN is left out: on an H100 (torch 2.11) it ran these shapes up to 2-4x
    slower than FlashAttention.  A prefill (q == kv length) is plain causal SDPA.
    """
    kv_len = kwargs.get("verify_kv_len")
    if kv_len is not None:
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    batch, heads, q_len, head_dim = query.shape
    if q_len == key.shape[2]:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        packed = query.reshape(batch, key.shape[1], heads // key.shape[1] * q_len, head_dim)
        with sdpa_kernel(PACKED_BACKENDS):
            out = F.scaled_dot_product_attention(packed, key, value, scale=scaling)
        out = out.view(batch, heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, gqa_attention)


def build_model(preset: str, device: torch.device, dtype: torch.dtype, attn: str) -> PreTrainedModel:
    """The preset's architecture with random weights, created directly on `device` in `dtype`."""
    config_class, shape = PRESETS[preset]
    config = config_class(**shape, max_position_embeddings=32768)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def kv_bytes(model: PreTrainedModel, batch: int, tokens: int) -> int:
    """Bytes of K and V for `batch` rows of `tokens` tokens."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    return per_token * batch * tokens


def prefill(model: PreTrainedModel, length: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of one sequence of `length` random tokens, shape (1, kv_heads, length, head_dim)."""
    cache = DynamicCache()
    tokens = torch.randint(model.config.vocab_size, (1, length), device=device)
    model.model(input_ids=tokens, past_key_values=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def make_cache(kind: str, model: PreTrainedModel, base: list[tuple[torch.Tensor, torch.Tensor]], batch: int,
               capacity: int) -> DynamicCache | StaticCache:
    """A batch-`batch` cache holding the prefilled sequence in every row (static: room for `capacity` tokens)."""
    cache: DynamicCache | StaticCache
    if kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        for idx, (k, v) in enumerate(base):
            cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), idx)
    else:
        cache = DynamicCache()
        for idx, (k, v) in enumerate(base):
            cache.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), idx)
    return cache


def rewind_static(cache: StaticCache, length: int) -> Step:
    """A function that sets every layer's write position of `cache` back to `length`."""
    counters = [getattr(layer, "cumulative_length", None) for layer in cache.layers]
    if not all(isinstance(c, torch.Tensor) for c in counters):
        raise RuntimeError(f"transformers {transformers_version}: StaticLayer has no cumulative_length tensor; "
                           "use --cache dynamic")

    def rewind() -> None:
        for counter in counters:
            counter.fill_(length)  # type: ignore[union-attr]
    return rewind


def make_step(model: PreTrainedModel, cache: DynamicCache | StaticCache, batch: int, length: int,
              q: int) -> tuple[Step, Step]:
    """(step, reset): one forward of q new tokens per row over the length-L cache, and the undo of its writes."""
    device = model.device
    tokens = torch.randint(model.config.vocab_size, (batch, q), device=device)
    positions = torch.arange(length, length + q, device=device).unsqueeze(0)
    extra = {"verify_kv_len": length + q} if model.config._attn_implementation == ATTN_NAME else {}

    def step() -> object:
        return model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True,
                     **extra).logits

    if isinstance(cache, StaticCache):
        return step, rewind_static(cache, length)
    return step, lambda: cache.crop(-q)


def graph_step(step: Step, reset: Step, pool: Any) -> torch.cuda.CUDAGraph:
    """Capture reset + step in one CUDA graph (after warm-up on a side stream, as torch.cuda.graph requires)."""
    def body() -> None:
        reset()
        step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    reset()
    return graph


def time_rounds(calls: dict[int, tuple[Step, Step]], warmup: int, repeats: int, cuda: bool) -> dict[int, list[float]]:
    """Milliseconds per call of each q's step, `reset` untimed after each; q interleaved round by round.

    Interleaving exposes every q to the same interference (other processes, clocks), so the ratios
    stay steadier than the absolute times.
    """
    for _ in range(warmup):
        for step, reset in calls.values():
            step()
            reset()
    marks: dict[int, list[Any]] = {q: [] for q in calls}
    for _ in range(repeats):
        for q, (step, reset) in calls.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                marks[q].append((start, end))
            else:
                synchronize()
                begin = time.perf_counter()
                step()
                synchronize()
                marks[q].append((time.perf_counter() - begin) * 1e3)
            reset()
    if not cuda:
        return marks
    torch.cuda.synchronize()
    return {q: [start.elapsed_time(end) for start, end in pairs] for q, pairs in marks.items()}


def measure_point(model: PreTrainedModel, base: list[tuple[torch.Tensor, torch.Tensor]], batch: int, length: int,
                  qs: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Step times for every q at one (B, L): medians and samples in ms."""
    cuda = model.device.type == "cuda"
    graphs = cuda and args.cache == "static" and not args.no_cuda_graphs
    cache = make_cache(args.cache, model, base, batch, length + max(qs))
    pool = torch.cuda.graph_pool_handle() if graphs else None
    calls: dict[int, tuple[Step, Step]] = {}
    for q in qs:
        step, reset = make_step(model, cache, batch, length, q)
        if graphs:  # the graphs share one memory pool; each replays reset + step, so nothing is left to reset
            calls[q] = (graph_step(step, reset, pool).replay, lambda: None)
        else:
            calls[q] = (step, reset)
    samples = {str(q): times for q, times in time_rounds(calls, args.warmup, args.repeats, cuda).items()}
    return {"t_ms": {q: statistics.median(s) for q, s in samples.items()}, "samples_ms": samples}


def ratios(point: dict[str, Any], ks: list[int]) -> dict[str, float]:
    """t(k+1) / t(1) per k: the break-even mean acceptance length."""
    t = point["t_ms"]
    return {str(k): t[str(k + 1)] / t["1"] for k in ks}


def free_bytes(device: torch.device) -> int | None:
    """Free accelerator memory, or None on CPU."""
    if device.type in ("cuda", "npu"):
        return int(getattr(torch, device.type).mem_get_info(device)[0])
    return None


def release(device: torch.device) -> None:
    """Drop cached allocator blocks after a point."""
    gc.collect()
    if device.type in ("cuda", "npu"):
        getattr(torch, device.type).empty_cache()


def synchronize() -> None:
    """Wait for an Ascend NPU's queued work (torch_npu), so host timers time it; nothing elsewhere."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        npu.synchronize()


def run_model(preset: str, args: argparse.Namespace, result: dict[str, Any], deadline: float) -> None:
    """Measure every (L, B) point of one model into result["points"], writing the JSON after each."""
    device = torch.device(args.device)
    qs = [1, *sorted({k + 1 for k in args.ks})]
    model = build_model(preset, device, args.dtype, args.attn)
    result["models"][preset] = {"params": sum(p.numel() for p in model.parameters()),
                                "config": PRESETS[preset][1]}
    for length in args.lengths:
        base = prefill(model, length, device)
        for batch in args.batches:
            point: dict[str, Any] = {"model": preset, "L": length, "B": batch,
                                     "kv_cache_gib": kv_bytes(model, batch, length) / 2**30}
            free = free_bytes(device)
            if time.monotonic() > deadline:
                point["status"] = "skipped: budget"
            elif free is not None and kv_bytes(model, batch, length + max(qs)) > 0.9 * free:
                point["status"] = "skipped: OOM (KV cache would not fit)"
            else:
                try:
                    point |= measure_point(model, base, batch, length, qs, args)
                    point["ratio"] = ratios(point, args.ks)
                    point["status"] = "ok"
                except torch.OutOfMemoryError:
                    point["status"] = "skipped: OOM"
            result["points"].append(point)
            release(device)
            report_point(point, args.ks)
            if args.json_path:
                Path(args.json_path).write_text(json.dumps(result, indent=1))
        del base
    del model
    release(device)


def report_point(point: dict[str, Any], ks: list[int]) -> None:
    """One progress line per point."""
    head = f"{point['model']} L={point['L']} B={point['B']}"
    if point["status"] != "ok":
        print(f"{head}: {point['status']}", flush=True)
        return
    ratio = " ".join(f"k={k}:{point['ratio'][str(k)]:.2f}" for k in ks)
    print(f"{head}: t1={point['t_ms']['1']:.2f} ms  ratio {ratio}", flush=True)


def print_table(result: dict[str, Any], ks: list[int], mals: list[float], mal_k: int) -> None:
    """Per model and L: t(1), t(k+1) and the ratio (= break-even MAL) per k, and MAL / ratio(mal_k)."""
    print("\nratio = t(k+1)/t(1) = break-even mean acceptance length (accepted + bonus per verification)")
    head = f"{'model':<13} {'L':>6} {'B':>4} {'t1 ms':>8}"
    head += "".join(f" {f't{k + 1} ms':>8} {f'r k={k}':>7}" for k in ks)
    head += "".join(f" {f'x@{mal:g}':>7}" for mal in mals)
    print(head + (f"   (x@MAL = MAL / ratio at k={mal_k})" if mals else ""))
    for p in result["points"]:
        row = f"{p['model']:<13} {p['L']:>6} {p['B']:>4}"
        if p["status"] != "ok":
            print(f"{row} {p['status']}")
            continue
        row += f" {p['t_ms']['1']:>8.2f}"
        row += "".join(f" {p['t_ms'][str(k + 1)]:>8.2f} {p['ratio'][str(k)]:>7.2f}" for k in ks)
        row += "".join(f" {mal / p['ratio'][str(mal_k)]:>7.2f}" for mal in mals)
        print(row)


def plot(result: dict[str, Any], ks: list[int], mals: list[float], path: str) -> None:
    """Ratio vs batch size, one line per k (and per model), one panel per L, MALs as horizontal lines."""
    points = [p for p in result["points"] if p["status"] == "ok"]
    lengths = sorted({p["L"] for p in points})
    models = list(dict.fromkeys(p["model"] for p in points))
    if not lengths:
        return
    fig, axes = subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False, sharey=True)
    styles = ["-", "--", ":", "-."]
    for ax, length in zip(axes[0], lengths, strict=True):
        for m_idx, model in enumerate(models):
            rows = sorted((p for p in points if p["L"] == length and p["model"] == model), key=lambda p: p["B"])
            for k_idx, k in enumerate(ks):
                label = f"k={k}" + (f" {model}" if len(models) > 1 else "")
                ax.plot([p["B"] for p in rows], [p["ratio"][str(k)] for p in rows], styles[m_idx % len(styles)],
                        marker="o", color=f"C{k_idx}", label=label)
        for mal in mals:
            ax.axhline(mal, color="grey", linewidth=0.8, linestyle="--")
            ax.text(0.01, mal, f"MAL {mal:g}", transform=ax.get_yaxis_transform(), fontsize=8, color="grey",
                    va="bottom")
        batches = sorted({p["B"] for p in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size B")
        ax.set_title(f"L = {length}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("t(k+1) / t(1) = break-even MAL")
    axes[0][-1].legend(fontsize=8)
    env = result["environment"]
    where = env["device_name"] + (f" ({env['cpu_threads']} threads)" if env["device"] == "cpu" else "")
    fig.suptitle(f"verification cost, {', '.join(models)}, {where}, {env['dtype']}, {env['cache']} cache"
                 f"{', CUDA graphs' if env['cuda_graphs'] else ''}", fontsize=10)
    save(fig, path, dpi=120)


def int_list(text: str) -> list[int]:
    """Parse "1,2,4"."""
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    """Command line; sizes default to the GPU sweep on CUDA and a ~1-minute sweep on CPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=lambda s: s.split(","), default=None,
                        help=f"comma list of {list(PRESETS)} (default: qwen3-8b on CUDA, smollm2-135m on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", type=int_list, help="default 1,2,4,8,16,32,64 (CPU: 1,4,16)")
    parser.add_argument("--lengths", type=int_list, help="context lengths L, default 1024,8192 (CPU: 256)")
    parser.add_argument("--ks", type=int_list, default=[1, 2, 3, 4, 8], help="draft lengths k")
    parser.add_argument("--warmup", type=int, help="warm-up steps per point and q (default 5, CPU 2)")
    parser.add_argument("--repeats", type=int, help="timed steps per point and q, median taken (default 20, CPU 10)")
    parser.add_argument("--cache", choices=["static", "dynamic"], default="static")
    parser.add_argument("--attn", choices=[ATTN_NAME, "sdpa", "eager"], default=ATTN_NAME)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="time eager steps on CUDA")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="stop adding points after this many seconds (from start), keeping what was measured")
    parser.add_argument("--mal", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                        help="measured mean acceptance lengths: reference lines and projected speedup MAL / ratio")
    parser.add_argument("--mal-k", type=int, default=3, help="draft length k the --mal values were measured at")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()
    cpu = torch.device(args.device).type == "cpu"
    args.model = args.model or ["smollm2-135m" if cpu else "qwen3-8b"]
    args.dtype = DTYPES[args.dtype or ("float32" if cpu else "bfloat16")]
    args.batches = args.batches or ([1, 4, 16] if cpu else [1, 2, 4, 8, 16, 32, 64])
    args.lengths = args.lengths or ([256] if cpu else [1024, 8192])
    args.warmup = args.warmup if args.warmup is not None else (2 if cpu else 5)
    args.repeats = args.repeats or (10 if cpu else 20)
    args.ks = sorted(set(args.ks) | ({args.mal_k} if args.mal else set()))
    unknown = set(args.model) - set(PRESETS)
    if unknown:
        parser.error(f"unknown model preset(s) {sorted(unknown)}; known: {list(PRESETS)}")
    return args


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions, device and the measurement settings, for the JSON."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        name = torch.cuda.get_device_name(device)
    elif device.type == "npu":
        name = torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    else:
        name = platform.processor() or platform.machine()
    return {"torch": torch.__version__, "transformers": transformers_version, "python": platform.python_version(),
            "device": str(device), "device_name": name, "cpu_threads": torch.get_num_threads(),
            "dtype": str(args.dtype).removeprefix("torch."), "cache": args.cache, "attn": args.attn,
            "cuda_graphs": cuda and args.cache == "static" and not args.no_cuda_graphs}


def main() -> None:
    """Sweep the models, (L, B) points and q, print the table, write JSON and the plot."""
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = time.monotonic() + args.budget_s
    settings = {k: v for k, v in vars(args).items() if k not in ("dtype", "json_path", "plot_path")}
    settings["budget_s"] = None if args.budget_s == float("inf") else args.budget_s
    result: dict[str, Any] = {"environment": environment(args), "settings": settings, "models": {}, "points": []}
    print(json.dumps(result["environment"]), flush=True)
    started = time.monotonic()
    with torch.inference_mode():
        for preset in args.model:
            run_model(preset, args, result, deadline)
    result["wall_s"] = time.monotonic() - started
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    print_table(result, args.ks, args.mal, args.mal_k)
    if args.plot_path:
        plot(result, args.ks, args.mal, args.plot_path)


if __name__ == "__main__":
    main()
