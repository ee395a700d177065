"""SAM inside the real engine vs no speculation and vLLM's ngram and suffix: throughput, acceptance, makespan.

    python bench/spec_engine.py --repeats 3 --json out/spec_engine.json --plot out/spec_engine.png

Every mode runs in its own process on the same prompts (greedy, or sampled at
--temperature without seeds, as RL rollouts are: sampled requests draft on the CPU backend
too since the cpu_sampled_verification plugin): decode throughput at several batch
sizes, then a rollout-shaped workload whose max_tokens are heavy-tailed, reporting its
makespan, the time and engine steps spent in the tail (at most --tail requests running), and
its mean acceptance length.  Requests for
the same prompt carry one group id, as the trainer client sends GRPO siblings (--no-groups:
none); with greedy decoding such siblings are identical, the best case for drafting across
them (and for vLLM's suffix method, whose global cache holds earlier responses).  With
--repeats N the modes run N rounds, interleaved (off, sam, ..., off, sam, ...), so slow
drift of the machine hits every mode alike; the table shows the median and the range.
The adaptive policy also reports the step cost it fitted per batch-size octave.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from harness import in_turn, interleaved, write_json

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(proposer_stats)

MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    # The server's defaults on this device (`ServerSettings().speculation_config`).
    "sam-default": {"method": "sam", "server_defaults": True},
    # The static threshold, and confident drafts past it (confident_match 8, see below): the CPU default.
    "sam-static": {"method": "sam", "threshold_mode": "static"},
    # A draft range: k drafts while at most 32 requests run, none above (what drafting always is for the
    # 32-request rollout).
    "sam-range-32": {"method": "sam", "threshold_mode": "static", "draft_range": ((32, 3),)},
    # The static threshold alone (the default until 2026-11-26): nothing drafts past it.
    "sam-static-only": {"method": "sam", "threshold_mode": "static", "confident_match": 0},
    # The adaptive policy with the bench's settings (the server's defaults are sam-default).
    "sam-adaptive": {"method": "sam", "threshold_mode": "adaptive"},
    "sam-always": {"method": "sam", "threshold_mode": "off"},
    # DraftPolicy.min_match_length: the sam-* modes above use the default, "auto" (2 on CPU, 1 on
    # GPUs/NPUs); these fix it: matches shorter than 1 (2, 4) tokens propose nothing.
    "sam-static-m1": {"method": "sam", "threshold_mode": "static", "min_match_length": 1},
    "sam-static-m2": {"method": "sam", "threshold_mode": "static", "min_match_length": 2},
    "sam-static-m4": {"method": "sam", "threshold_mode": "static", "min_match_length": 4},
    # SpeculationConfig.confident_match (default 8): past the threshold, rows whose match is at least this
    # long draft.
    # DraftPolicy.max_global_tokens: a global index of finished responses to every prompt (off by default).
    "sam-static-global": {"method": "sam", "threshold_mode": "static", "max_global_tokens": 1 << 20},
    "sam-always-global": {"method": "sam", "threshold_mode": "off", "max_global_tokens": 1 << 20},
    "sam-confident-8": {"method": "sam", "threshold_mode": "static", "confident_match": 8},
    "sam-confident-16": {"method": "sam", "threshold_mode": "static", "confident_match": 16},
    "sam-confident-16-global": {"method": "sam", "threshold_mode": "static", "confident_match": 16,
                                "max_global_tokens": 1 << 20},
    "sam-confident-32": {"method": "sam", "threshold_mode": "static", "confident_match": 32},
    "sam-confident-64": {"method": "sam", "threshold_mode": "static", "confident_match": 64},
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},  # at --k
    # vLLM's default k for suffix (num_speculative_tokens unset: vLLM sets it to the tree depth, 24), and fixed k's
    "suffix-default": {"method": "suffix", "k": None},
    **{f"suffix-k{k}": {"method": "suffix", "k": k} for k in (3, 8, 24)},
}
QUESTIONS = [
    "Explain step by step how to compute 347 * 29, then check the result.",
    "Write a Python function that sorts a list with insertion sort and explain each line.",
    "List the first 30 square numbers, one per line, with how each is computed.",
    "Describe the water cycle in detail, step by step.",
    "Write a story about a robot who learns to paint, in several paragraphs.",
    "Solve: a train goes 60 km/h for 2.5 hours, then 80 km/h for 1.75 hours. Total distance? Show work.",
    "Count from 1 to 60, separated by commas.",
    "Write an HTML page with a table of five fruits and their colours.",
]


def _engine_args(mode: str, k: int, threshold: int) -> dict[str, Any]:
    from samrollout.config import SpeculationConfig
    from samrollout.engine import engine_kwargs
    from samrollout.models import ensure_smollm2

    model = str(ensure_smollm2())
    base = {"gpu_memory_utilization": 0.3, "max_model_len": 4096, "seed": 0, "disable_log_stats": False}
    setting = MODES[mode]
    if setting is None:
        return engine_kwargs(model, None, **base)
    if setting["method"] == "ngram":
        return engine_kwargs(model, None, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                              "prompt_lookup_min": 5, "prompt_lookup_max": 5}, **base)
    if setting["method"] == "suffix":  # vLLM's SuffixDecoding (arctic-inference): its defaults but k
        spec: dict[str, Any] = {"method": "suffix"}
        suffix_k = setting.get("k", k)
        if suffix_k is not None:  # None: vLLM's default k (the tree depth)
            spec["num_speculative_tokens"] = suffix_k
        return engine_kwargs(model, None, speculative_config=spec, **base)
    if setting.get("server_defaults"):
        from samrollout.server.engine.startup import platform_device_kind
        from samrollout.server.settings import ServerSettings

        return engine_kwargs(model, ServerSettings(k=k, threshold=threshold).speculation_config(
            platform_device_kind()), **base)
    from samrollout.drafter import DraftPolicy

    policy = DraftPolicy(min_match_length=setting.get("min_match_length", "auto"),
                         max_global_tokens=setting.get("max_global_tokens", DraftPolicy.max_global_tokens))
    config = SpeculationConfig(k=k, threshold_mode=setting["threshold_mode"], threshold=threshold, policy=policy,
                               confident_match=setting.get("confident_match", SpeculationConfig.confident_match),
                               draft_range=setting.get("draft_range"))
    return engine_kwargs(model, config, **base)


def proposer_stats(worker: Any) -> dict[str, Any]:
    """The SAM proposer's counters and settings (runs inside the worker), as `ProposerStats.to_json`."""
    result: dict[str, Any] = worker.model_runner.drafter.stats().to_json()
    return result


def _spec_counts(llm: Any) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:spec_decode_num_draft_tokens")}


def _acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean acceptance length and acceptance rate between two `_spec_counts` readings."""
    def grew(name: str) -> float:
        return after.get(f"vllm:spec_decode_num_{name}", 0) - before.get(f"vllm:spec_decode_num_{name}", 0)

    drafts, accepted, drafted = grew("drafts"), grew("accepted_tokens"), grew("draft_tokens")
    return {"mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0}


def _group(index: int, prompts: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Requests for the same prompt share a group id (as the trainer client sets for GRPO siblings)."""
    from samrollout.config import GROUP_FIELD

    return {GROUP_FIELD: f"prompt-{index % prompts}"} if args.groups else None


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything measured for one mode (runs inside its own process)."""
    from vllm import LLM, SamplingParams

    from samrollout.engine import use_every_cpu_core
    from samrollout.spec_decode.stats import ProposerStats

    use_every_cpu_core()  # every mode's worker gets the cores the server gives it
    llm = LLM(**_engine_args(mode, args.k, args.threshold))
    chats: list[Any] = [[{"role": "user", "content": q}] for q in QUESTIONS]
    llm.chat(chats[:2], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # warm-up
    out: dict[str, Any] = {"mode": mode, "batches": [batch_throughput(llm, chats, batch, args)
                                                     for batch in args.batch_sizes]}
    out["rollout"] = rollout(llm, chats, args)
    setting = MODES[mode]
    if setting is not None and setting["method"] == "sam":
        proposer = ProposerStats.from_json(llm.collective_rpc(proposer_stats)[0])
        out["drafter_us_per_step"] = 1e6 * proposer.propose_seconds / max(1, proposer.steps)
        out["step_cost"] = proposer.to_json()["step_cost"]  # the adaptive policy's fit: [u, w, v, observations]
    return out


def batch_throughput(llm: Any, chats: list[Any], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Decode throughput and acceptance of one batch of ``batch`` chats, all submitted at once."""
    from vllm import SamplingParams

    before = _spec_counts(llm)
    convs = [chats[i % len(chats)] for i in range(batch)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                             extra_args=_group(i, len(chats), args)) for i in range(batch)]
    start = time.perf_counter()
    results = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return {"batch": batch, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            **_acceptance(before, _spec_counts(llm))}


def rollout(llm: Any, chats: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The rollout: heavy-tailed lengths (most short, a few long), all submitted at once, stepped to the end;
    its makespan, its tail, its engine steps and every finished request's tokens."""
    import numpy as np
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    lengths = np.minimum((rng.pareto(1.2, size=args.rollout) + 1) * 24, args.rollout_max).astype(int).tolist()
    convs = [chats[i % len(chats)] for i in range(args.rollout)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True,
                             extra_args=_group(i, len(chats), args)) for i, n in enumerate(lengths)]
    before = _spec_counts(llm)
    start = time.perf_counter()
    finished: list[float] = []
    sequences: list[dict[str, Any]] = []  # each finished request's tokens, for the rollout simulator's traces
    steps = tail_steps = 0
    for i, conv in enumerate(convs):
        llm.llm_engine.add_request(f"r{i}", llm.get_tokenizer().apply_chat_template(conv, tokenize=False,
                                                                                   add_generation_prompt=True),
                                   params[i])
    while llm.llm_engine.has_unfinished_requests():
        steps += 1
        tail_steps += len(finished) >= args.rollout - args.tail  # at most --tail requests left running
        for output in llm.llm_engine.step():
            if output.finished:
                finished.append(time.perf_counter() - start)
                index = int(output.request_id.removeprefix("r"))
                sequences.append({"prompt_id": f"prompt-{index % len(chats)}", "request": index,
                                  "prompt_ids": list(output.prompt_token_ids),
                                  "response_ids": list(output.outputs[0].token_ids)})
    acceptance = _acceptance(before, _spec_counts(llm))
    makespan = max(finished)
    finished.sort()
    tail_start = finished[-args.tail - 1] if len(finished) > args.tail else 0.0
    return {"requests": args.rollout, "tokens": sum(lengths), "makespan_s": makespan,
            "tail_s": makespan - tail_start, "tail_share": (makespan - tail_start) / makespan,
            "steps": steps, "tail_steps": tail_steps, "mean_acceptance_length": acceptance["mean_acceptance_length"],
            "max_num_seqs": int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs),
            "sequences": sorted(sequences, key=lambda seq: seq["request"])}


def run_child(cmd: list[str]) -> None:
    """Run one mode in its own process group, and kill the whole group however this ends: vLLM's
    EngineCore and worker processes outlive a killed child otherwise (holding gigabytes)."""
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        if child.wait() != 0:
            raise subprocess.CalledProcessError(child.returncode, cmd)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring; ``--child MODE:PATH`` is how `run_modes` runs one mode)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=8)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                        default=[1, 4, 16, 64],
                        help="decode throughput batch sizes measured before the rollout ('': none)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all modes (median reported)")
    parser.add_argument("--groups", action=argparse.BooleanOptionalAction, default=True,
                        help="requests for the same prompt carry one group id (SAM drafts across them)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above: sampled, unseeded (every round draws anew)")
    parser.add_argument("--rollout", type=int, default=32, help="requests in the rollout workload")
    parser.add_argument("--rollout-max", type=int, default=768, help="cap of the heavy-tailed max_tokens")
    parser.add_argument("--tail", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def run_modes(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every mode in a child process of its own, ``--repeats`` rounds of all modes in turn: each mode's runs."""
    # A SIGTERM (pkill) unwinds like Ctrl-C does, so run_child still kills the mode's process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for round_index, mode in interleaved(modes, args.repeats, order=in_turn):
        path = Path(f"/tmp/spec_engine_{os.getpid()}_{mode}.json")
        run_child([sys.executable, __file__, "--child", f"{mode}:{path}", *sys.argv[1:]])
        runs[mode].append(json.loads(path.read_text()))
        path.unlink()
        print(f"done: round {round_index + 1}/{args.repeats} {mode}", flush=True)
    return runs


def main() -> None:
    """Run every mode in a child process, then print the table and write JSON / plot."""
    args = parse_args()
    if args.child:
        mode, path = args.child.split(":", 1)
        Path(path).write_text(json.dumps(run_mode(mode, args)))
        return
    results = [summarise(mode, mode_runs) for mode, mode_runs in run_modes(args).items()]
    print_table(results, args.batch_sizes)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    if args.plot:
        write_plot(results, args.plot, args.tail)


def summarise(mode: str, mode_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median (and min, max) of each figure over the repeats of one mode; the runs themselves kept."""
    batches = []
    for index, first in enumerate(mode_runs[0]["batches"]):
        rows = [run["batches"][index] for run in mode_runs]
        batches.append({"batch": first["batch"],
                        **{key: median([row[key] for row in rows])
                           for key in ("tokens_per_s", "mean_acceptance_length", "acceptance_rate")},
                        "tokens_per_s_range": [min(r["tokens_per_s"] for r in rows),
                                               max(r["tokens_per_s"] for r in rows)]})
    makespans = [run["rollout"]["makespan_s"] for run in mode_runs]
    tails = [run["rollout"]["tail_s"] for run in mode_runs]
    summary: dict[str, Any] = {
        "mode": mode, "repeats": len(mode_runs), "batches": batches,
        "rollout": {"makespan_s": median(makespans), "makespan_range_s": [min(makespans), max(makespans)],
                    "tail_s": median(tails), "tail_range_s": [min(tails), max(tails)],
                    **{key: median([run["rollout"].get(key, float("nan")) for run in mode_runs])
                       for key in ("steps", "tail_steps", "mean_acceptance_length")}},
        "runs": mode_runs}
    if "drafter_us_per_step" in mode_runs[0]:
        summary["drafter_us_per_step"] = median([run["drafter_us_per_step"] for run in mode_runs])
    return summary


def print_table(results: list[dict[str, Any]], batch_sizes: list[int]) -> None:
    """Medians over the repeats; the makespan's range in brackets."""
    header = f"{'mode':<14}" + "".join(f"{f'tok/s@{b}':>11}{'MAL':>6}" for b in batch_sizes)
    header += f"{'makespan s [range]':>22}{'tail s':>8}{'steps':>7}{'tail':>6}{'MAL':>6}{'drafter us':>12}"
    print(header)
    for r in results:
        row = f"{r['mode']:<14}" + "".join(f"{b['tokens_per_s']:>11.1f}{b['mean_acceptance_length']:>6.2f}"
                                           for b in r["batches"])
        low, high = r["rollout"]["makespan_range_s"]
        row += f"{r['rollout']['makespan_s']:>9.2f} [{low:5.2f}-{high:5.2f}]{r['rollout']['tail_s']:>8.2f}"
        rollout = r["rollout"]
        row += f"{rollout['steps']:>7.0f}{rollout['tail_steps']:>6.0f}{rollout['mean_acceptance_length']:>6.2f}"
        row += f"{r.get('drafter_us_per_step', float('nan')):>12.1f}"
        print(row)
    for r in results:
        for run_index, run in enumerate(r["runs"]):
            if run.get("step_cost"):
                print(f"{r['mode']} step-cost fit, run {run_index + 1} (level, switch, draft weight, steps):")
                for octave, (u, w, v, n) in run["step_cost"].items():
                    print(f"  running {octave:>5}: {u:.2f} {w:.2f} {v:.2f} ({n:.0f})")


def write_plot(results: list[dict[str, Any]], path: str, tail: int) -> None:
    """Tokens/s against batch size per mode, and the rollout's makespan with its tail."""
    from plotting import save, subplots

    fig, axes = subplots(1, 2, figsize=(11, 4))
    for r in results:
        axes[0].plot([b["batch"] for b in r["batches"]], [b["tokens_per_s"] for b in r["batches"]],
                     marker="o", label=r["mode"])
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("batch size")
    axes[0].set_title("output tokens/s (greedy)")
    axes[0].legend(fontsize=8)
    names = [r["mode"] for r in results]
    axes[1].bar(names, [r["rollout"]["makespan_s"] for r in results], label="makespan")
    axes[1].bar(names, [r["rollout"]["tail_s"] for r in results], label=f"tail (<= {tail} running)")
    axes[1].set_title("rollout makespan, s")
    axes[1].legend(fontsize=8)
    axes[1].tick_params(axis="x", rotation=20)
    save(fig, path)


if __name__ == "__main__":
    main()
