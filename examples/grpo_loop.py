"""A minimal GRPO-shaped loop against a running samrollout server (the built-in model by default).

    samrollout serve &                       # in another shell; wait for "Application startup complete"
    python examples/grpo_loop.py --steps 3 --groups 8 --n 8

Each step samples a group of n responses per arithmetic question, scores them with a
verifiable reward (1 if the response's final answer is the right one, else 0),
computes GRPO's group-normalised advantages ((r - mean) / (std + eps) within each group)
and prints the rollout report (makespan, tail share, acceptance).  There is NO training
step: a real trainer would update the policy from (tokens, logprobs, advantages) here and
then call ``client.update_weights(path, version)`` before the next step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from math_reward import correct

from samrollout_client import RolloutClient, Sampling


def make_questions(count: int, rng: random.Random) -> list[tuple[str, int]]:
    """Arithmetic questions as completion prompts, with their answers."""
    questions = []
    for _ in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        op = rng.choice(["+", "-", "*"])
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        questions.append((f"Question: What is {a} {op} {b}? Think step by step, then give the number.\nAnswer:",
                          answer))
    return questions


def reward(text: str, answer: int) -> float:
    """1.0 if the response's final answer is the right one (`math_reward.final_answer`), else 0.0 (a verifiable
    reward)."""
    return 1.0 if correct(text, answer) else 0.0


def advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO's group-normalised advantages."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def main() -> None:
    """Run the loop and print per-step rewards, advantages and the rollout report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", help="server URL (repeat for several); default localhost:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8, help="questions per step")
    parser.add_argument("--n", type=int, default=8, help="responses per question (the GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    urls = args.url or ["http://127.0.0.1:8000"]
    with RolloutClient(urls, model=args.model, api_key=args.api_key, progress=True) as client:
        for step in range(args.steps):
            questions = make_questions(args.groups, rng)
            rollout_id = f"grpo-step-{step}-{int(time.time())}"
            groups = client.generate([q for q, _ in questions], n=args.n, rollout_id=rollout_id,
                                     sampling=Sampling(max_tokens=args.max_tokens, temperature=1.0,
                                                       seed=args.seed + 1000 * step))
            all_rewards = []
            for group, (_, answer) in zip(groups, questions, strict=True):
                rewards = [reward(s.text, answer) for s in group.samples]
                all_rewards += rewards
                group_advantages = advantages(rewards)
                print(f"  q{group.index}: answer {answer:>5}  rewards {rewards}  "
                      f"advantages [{', '.join(f'{a:+.2f}' for a in group_advantages)}]")
            time.sleep(2.5)  # the server closes a rollout's summary 2 s after its last response
            print(f"step {step}: mean reward {statistics.fmean(all_rewards):.3f}")
            print(f"  {client.report(rollout_id)}")


if __name__ == "__main__":
    main()
