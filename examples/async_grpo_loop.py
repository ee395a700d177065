"""An asynchronous GRPO-shaped loop against a running samrollout server: partial rollouts, weights that continue.

    samrollout serve &                       # in another shell; wait for "Application startup complete"
    python examples/async_grpo_loop.py --steps 4 --weights ~/.cache/samrollout/models/smollm2-135m-instruct

Each step takes the first ``--groups`` GRPO groups (``--n`` responses to one arithmetic
question) to finish from a partial rollout (`AsyncRolloutClient.partial_rollout`); the
responses still generating keep going while the "trainer" works.  The trainer here is
simulated: it scores each group (1 if the response's final answer is the right one),
computes GRPO's group-normalised advantages, reads which weight version sampled
each token (`Sample.weight_version_spans`) to weigh the off-policy ones, sleeps
``--train-s`` in place of a gradient step, and pushes new weights with
``in_flight="continue"``: the responses in flight go on under them, in the same HTTP
responses.  ``--weights`` is a directory of ``*.safetensors`` with the served model's tensors
(the built-in model's checkpoint: the path above; each push sends it again under a new
version, standing in for the trained weights); without it nothing is pushed and every
sample comes from one version.

The off-policy weight shown is what decoupled PPO / truncated importance sampling needs per
token: the sampling policy's logprob (``sample.logprobs``, from the version that sampled the
token) against the trainer's.  This loop has no trainer model, so it prints how many tokens
are off-policy (sampled by an older version than the one being trained) and how stale the
samples are; a real trainer computes ``min(exp(logp_trainer - logp_sampled), clip)`` for them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator

from grpo_loop import advantages, reward  # the synchronous example's reward and GRPO advantages

from samrollout_client import AsyncRolloutClient, GroupResult, Sample, Sampling


def questions(rng: random.Random, answers: dict[str, int]) -> Iterator[str]:
    """Endless arithmetic questions as completion prompts; each answer is kept in ``answers`` by prompt."""
    while True:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        op = rng.choice(["+", "-", "*"])
        prompt = f"Question: What is {a} {op} {b}? Think step by step, then give the number.\nAnswer:"
        answers[prompt] = a + b if op == "+" else a - b if op == "-" else a * b
        yield prompt


def off_policy_mask(sample: Sample, history: list[str]) -> list[bool]:
    """True for each token sampled by an older version than the newest (the one the trainer now holds)."""
    return [lag > 0 for lag in sample.token_lags(history)]


def train_step(batch: list[GroupResult], answers: dict[str, int], history: list[str]) -> dict[str, float]:
    """The simulated trainer's bookkeeping: rewards, advantages, and how off-policy the batch is."""
    rewards: list[float] = []
    tokens = off_policy = 0
    for group in batch:
        group_rewards = [reward(s.text, answers[str(group.prompt)]) for s in group.samples]
        rewards += group_rewards
        for sample, _advantage in zip(group.samples, advantages(group_rewards), strict=True):
            mask = off_policy_mask(sample, history)
            tokens, off_policy = tokens + len(mask), off_policy + sum(mask)
            # A real trainer: per token t, weight = min(exp(logp_trainer[t] - sample.logprobs[t]), clip) where
            # mask[t] (decoupled PPO's behaviour-policy correction), times _advantage, in its policy loss.
    return {"mean_reward": statistics.fmean(rewards), "tokens": tokens,
            "off_policy_share": off_policy / tokens if tokens else 0.0}


async def main_async(args: argparse.Namespace) -> None:
    """Run the loop; print per-step rewards, staleness and what the rollout carried over."""
    rng = random.Random(args.seed)
    answers: dict[str, int] = {}
    async with AsyncRolloutClient(args.url or ["http://127.0.0.1:8000"], model=args.model,
                                  api_key=args.api_key) as client:
        sampling = Sampling(max_tokens=args.max_tokens, temperature=1.0, logprobs=0, seed=args.seed)
        async with client.partial_rollout(questions(rng, answers), args.n, batch_groups=args.groups,
                                          sampling=sampling, max_staleness=args.max_staleness) as rollout:
            for step in range(args.steps):
                started = time.monotonic()
                batch = await rollout.next_batch()
                waited = time.monotonic() - started
                history = rollout.versions  # oldest first; the newest is what the trainer holds now
                staleness = Counter(s.staleness(history) for g in batch for s in g.samples)
                summary = train_step(batch, answers, history)
                await asyncio.sleep(args.train_s)  # the gradient step would run here
                if args.weights:
                    await client.push_weights(args.weights, version=f"step-{step + 1}", in_flight="continue")
                print(f"step {step}: waited {waited:.1f} s for {len(batch)} groups; mean reward "
                      f"{summary['mean_reward']:.3f}; staleness {dict(sorted(staleness.items()))}; "
                      f"off-policy tokens {100 * summary['off_policy_share']:.0f}%; {rollout.running} samples "
                      f"carried into the next step; serving {client.weight_versions[-1]}")
            print(f"rollout: {rollout.stats.model_dump()}")


def main() -> None:
    """Parse the command line and run the loop."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", help="server URL (repeat for several); default localhost:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8, help="groups per training batch")
    parser.add_argument("--n", type=int, default=8, help="responses per question (the GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="restart samples whose oldest token lags the newest version by more (default 1)")
    parser.add_argument("--train-s", type=float, default=5.0, help="the simulated gradient step")
    parser.add_argument("--weights", help="a directory of *.safetensors to push after each step (none: no push)")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
