"""A real GRPO run on a laptop: SmolLM2-135M-Instruct learns arithmetic with samrollout as its generator.

    SAMROLLOUT_API_KEY=secret samrollout serve &   # another shell; wait for "Application startup complete"
    python examples/grpo_cpu.py --mode sync --steps 30 --api-key secret --out runs/grpo-sync

The policy is the server's own built-in model, loaded here with transformers (float32, CPU).
Each step samples ``--groups`` GRPO groups of ``--n`` responses to "What is a + b?" questions
(a fixed set of ``--prompts`` questions, visited once per epoch in a new order), scores them with
a rule-based reward (`math_reward.arithmetic_reward`: 1 for a correct final answer, +0.5 for
a short answer that stopped on its own), takes one clipped policy-gradient step
(`grpo_policy.GrpoPolicy`) and pushes the new weights to every server (`push_weights`: relayed
server to server when they are each other's ``--weight-peers``), whose next samples come from
the policy just trained.

``--mode sync``: each step generates its batch, then trains, then pushes with
``in_flight="wait"`` (nothing is generating). ``--mode async``: a `partial_rollout` keeps
``2 x --groups`` groups generating while the trainer trains; each push uses
``in_flight="continue-keep-kv"``, so responses in flight go on under the new weights and their
tokens carry the version that sampled each (``weight_version_spans``). Responses that span
versions are *kept* and importance-weighted token by token: each token's logprob is the one its
own sampling version gave, so the clipped ratio ``exp(logp_now - logp_sampled)`` corrects every
token against the policy that really sampled it; responses more than ``--max-staleness``
versions behind (default 2, the client's) are restarted by the partial rollout, never trained on.

Every token's version is checked against the push log: it must be a version that was served
between the moment its prompt was handed to the rollout and the moment the batch came back.
``--out`` receives ``summary.json`` (per step: rewards, times, loss, versions), ``push-log.json``,
``rollouts.jsonl.gz`` (every response with its step, epoch, reward and version spans, in the
format `samrollout replay` and `samrollout simulate-rl` read) and ``grpo.png`` (mean reward per
step and each step's time split: rollout, train, push upload, load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from grpo_policy import GrpoPolicy, StepStats, weight_distance
from grpo_rollouts import (
    Curriculum,
    PushLog,
    StepRecord,
    score_batch,
    trace_records,
    write_plot,
    write_traces,
)
from tqdm import tqdm
from transformers import AutoTokenizer

from samrollout_client import AsyncRolloutClient, GroupResult, Sampling
from samrollout_client.rollout_rules import DEFAULT_MAX_STALENESS

BUILTIN_MODEL = Path.home() / ".cache" / "samrollout" / "models" / "smollm2-135m-instruct"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", help="server URL (repeat for several); default http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the served model name")
    p.add_argument("--policy", type=Path, default=BUILTIN_MODEL,
                   help="the served model's checkpoint directory, trained here (default: the built-in model's)")
    p.add_argument("--api-key", help="the servers' --api-key (weight pushes need it)")
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16, help="questions in the training set (one epoch)")
    p.add_argument("--groups", type=int, default=4, help="groups per training step")
    p.add_argument("--n", type=int, default=8, help="responses per question (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-staleness", type=int, default=DEFAULT_MAX_STALENESS,
                   help=f"async: restart samples more versions behind (default {DEFAULT_MAX_STALENESS}, the client's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/grpo"), help="folder for the summary, traces and plot")
    return p.parse_args(argv)


async def initial_version(urls: Sequence[str]) -> str:
    """The version the servers serve before the first push (every endpoint must agree)."""
    versions = set()
    async with httpx.AsyncClient(timeout=30.0) as http:
        for url in urls:
            versions.add((await http.get(f"{url.rstrip('/')}/health")).json()["weight_version"])
    if len(versions) != 1:
        raise SystemExit(f"the servers serve different weight versions: {sorted(versions)}")
    return versions.pop()


class Run:
    """One training run: the policy, the client, the question set, the push log, and what each step recorded."""

    def __init__(self, args: argparse.Namespace, client: AsyncRolloutClient, start_version: str) -> None:
        self.args, self.client = args, client
        self.tokenizer = AutoTokenizer.from_pretrained(str(args.policy))
        self.policy = GrpoPolicy(args.policy, lr=args.lr)
        self.initial_weights = self.policy.served_state()
        self.curriculum = Curriculum(self.tokenizer, args.prompts, args.seed)
        self.pushes = PushLog(start_version)
        self.steps: list[StepRecord] = []
        self.rollout_stats: dict[str, Any] | None = None  # the partial rollout's counters (async)
        self.started_at = time.time()
        self.traces: list[dict[str, Any]] = []
        self.sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, logprobs=0)

    async def train_and_push(self, step: int, batch: list[GroupResult], indices: Sequence[int],
                             rollout_s: float) -> StepRecord:
        """Score ``batch`` (``indices``: each group's position in the curriculum's stream), check its versions,
        take the gradient step (in a thread: the event loop keeps serving the rollout's streams), push the new
        weights; the step's record."""
        scored, rewards, trained_on = score_batch(batch, indices, self.curriculum)
        wrong = self.pushes.wrong_version_tokens(batch, indices, self.curriculum)
        self.traces += trace_records(batch, indices, self.curriculum, rewards, step)
        started = time.monotonic()
        stats: StepStats = await asyncio.to_thread(self.policy.train_step, scored)
        train_s = time.monotonic() - started
        in_flight = "wait" if self.args.mode == "sync" else "continue-keep-kv"
        version = f"{self.args.mode}-step-{step + 1}"
        weights = self.policy.served_state()
        push = await self.client.push_weights(weights, version=version, in_flight=in_flight)
        self.pushes.served(version, push, weight_distance(weights, self.initial_weights))
        flat = [r for group in rewards for r in group]
        record = StepRecord(
            step=step, mean_reward=statistics.fmean(flat),
            reward_se=statistics.stdev(flat) / len(flat) ** 0.5 if len(flat) > 1 else 0.0,
            accuracy=statistics.fmean(trained_on), samples=len(flat),
            tokens=sum(len(s.token_ids) for g in batch for s in g.samples),
            rollout_s=rollout_s, train_s=train_s, upload_s=push.upload_s, load_s=push.load_s,
            loss=stats.loss, grad_norm=stats.grad_norm, clipped_share=stats.clipped_share,
            mean_ratio=stats.mean_ratio, wrong_version_tokens=wrong,
            multi_version_samples=sum(len(s.versions) > 1 for g in batch for s in g.samples), version=version)
        self.steps.append(record)
        return record

    async def run_sync(self, bar: tqdm) -> None:
        """Generate a batch, train, push with ``in_flight="wait"``: one step at a time."""
        for step in range(self.args.steps):
            prompts = [self.curriculum.next_prompt(self.pushes.current) for _ in range(self.args.groups)]
            started = time.monotonic()
            groups = await self.client.generate(prompts, n=self.args.n, sampling=self.sampling,
                                                rollout_id=f"grpo-sync-{step}")
            indices = self.curriculum.last_indices(len(groups))
            self._report(bar, await self.train_and_push(step, groups, indices, time.monotonic() - started))

    async def run_async(self, bar: tqdm) -> None:
        """A partial rollout keeps generating while the trainer trains; pushes continue the responses in flight."""
        prompts = self.curriculum.endless(lambda: self.pushes.current)
        async with self.client.partial_rollout(prompts, self.args.n, batch_groups=self.args.groups,
                                               sampling=self.sampling, max_staleness=self.args.max_staleness,
                                               rollout_id="grpo-async") as rollout:
            for step in range(self.args.steps):
                started = time.monotonic()
                batch = await rollout.next_batch()
                indices = [group.index for group in batch]
                self._report(bar, await self.train_and_push(step, batch, indices, time.monotonic() - started))
            self.rollout_stats = rollout.stats.model_dump()

    def _report(self, bar: tqdm, record: StepRecord) -> None:
        bar.update(1)
        bar.set_postfix(reward=f"{record.mean_reward:.2f}", acc=f"{record.accuracy:.2f}",
                        rollout=f"{record.rollout_s:.0f}s", train=f"{record.train_s:.0f}s")

    def summary(self, wall_s: float) -> dict[str, Any]:
        """Everything the run measured, for ``summary.json``."""
        first, last = self.steps[:5], self.steps[-5:]
        samples = sum(r.samples for r in self.steps)
        return {"mode": self.args.mode, "args": {k: str(v) for k, v in vars(self.args).items()},
                "started_at": self.started_at, "wall_s": wall_s, "samples": samples, "samples_per_s": samples / wall_s,
                "reward_per_minute": sum(r.mean_reward * r.samples for r in self.steps) / (wall_s / 60.0),
                "first5_mean_reward": statistics.fmean(r.mean_reward for r in first),
                "last5_mean_reward": statistics.fmean(r.mean_reward for r in last),
                "reward_gain_se": _gain_se(first, last),
                "wrong_version_tokens": sum(r.wrong_version_tokens for r in self.steps),
                "rollout": self.rollout_stats,
                "steps": [vars(r) for r in self.steps]}


def _gain_se(first: Sequence[StepRecord], last: Sequence[StepRecord]) -> float:
    """The standard error of (mean of the last steps' rewards - mean of the first steps'), over step means."""
    def se(records: Sequence[StepRecord]) -> float:
        values = [r.mean_reward for r in records]
        return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return float((se(first) ** 2 + se(last) ** 2) ** 0.5)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train for ``args.steps`` steps against the servers; write the outputs to ``args.out``; the summary."""
    args.out.mkdir(parents=True, exist_ok=True)
    urls = args.url or ["http://127.0.0.1:8000"]
    async with AsyncRolloutClient(urls, model=args.model, api_key=args.api_key) as client:
        training = Run(args, client, await initial_version(urls))
        started = time.monotonic()
        with tqdm(total=args.steps, desc=f"GRPO {args.mode}", unit="step") as bar:
            await (training.run_sync(bar) if args.mode == "sync" else training.run_async(bar))
        summary = training.summary(time.monotonic() - started)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "push-log.json").write_text(json.dumps(training.pushes.entries, indent=1) + "\n")
    write_traces(args.out / "rollouts.jsonl.gz", training.traces)
    write_plot(args.out / "grpo.png", training.steps, f"GRPO on the CPU, {args.mode}: SmolLM2-135M, "
               f"{args.groups} x {args.n} samples per step")
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run from the command line; print the outcome; the summary."""
    summary = asyncio.run(run(parse_args(argv)))
    print(f"{summary['mode']}: {summary['samples']} samples in {summary['wall_s']:.0f} s "
          f"({summary['samples_per_s']:.2f} samples/s); mean reward first 5 steps "
          f"{summary['first5_mean_reward']:.3f}, last 5 {summary['last5_mean_reward']:.3f} "
          f"(+-{summary['reward_gain_se']:.3f}); tokens with a wrong version: {summary['wrong_version_tokens']}")
    return summary


if __name__ == "__main__":
    main()
