"""The rollout half of the CPU GRPO example: the question set, scoring, the version check, traces and the plot.

No torch here beyond `grpo_policy.ScoredSample`'s fields: what comes back from samrollout is
turned into rewards, advantages and trace lines, and every token's weight version is checked
against the versions this run pushed (`PushLog`).
"""

from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_loop import advantages
from grpo_policy import ScoredSample
from math_reward import arithmetic_reward, correct

from samrollout_client import GroupResult, Sample, WeightPush


@dataclass(frozen=True)
class Question:
    """One training question: its id, the chat-rendered prompt sent to the server, and its answer."""

    id: int
    text: str
    prompt: str
    answer: int


@dataclass(frozen=True)
class Pull:
    """A question handed to the rollout: which, in which epoch, and the version served at that moment."""

    question: Question
    epoch: int
    version: str


def make_questions(tokenizer: Any, count: int, seed: int) -> list[Question]:
    """``count`` distinct two-number additions, rendered with the model's chat template."""
    rng, seen, questions = random.Random(seed), set(), []
    while len(questions) < count:
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        text = f"What is {a} + {b}?"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
        questions.append(Question(len(questions), text, prompt, a + b))
    return questions


class Curriculum:
    """The question set, visited once per epoch in a new (seeded) order; remembers every question it handed out."""

    def __init__(self, tokenizer: Any, count: int, seed: int) -> None:
        self.questions = make_questions(tokenizer, count, seed)
        self._rng = random.Random(seed + 1)
        self._order: list[Question] = []
        self.pulled: list[Pull] = []

    def next_prompt(self, version: str) -> str:
        """The next question's prompt; ``version`` is the one served as it is handed out."""
        if not self._order:
            self._order = list(self.questions)
            self._rng.shuffle(self._order)
        question = self._order.pop(0)
        self.pulled.append(Pull(question, len(self.pulled) // len(self.questions), version))
        return question.prompt

    def endless(self, current_version: Callable[[], str]) -> Iterator[str]:
        """Prompts without end, for a partial rollout (``group.index`` is the position in this stream)."""
        while True:
            yield self.next_prompt(current_version())

    def last_indices(self, count: int) -> range:
        """The stream positions of the last ``count`` prompts handed out."""
        return range(len(self.pulled) - count, len(self.pulled))


def score_batch(batch: Sequence[GroupResult], indices: Sequence[int], curriculum: Curriculum
                ) -> tuple[list[ScoredSample], list[list[float]], list[float]]:
    """Rewards per group, the samples to train on with their GRPO advantages, and 1/0 correctness per sample."""
    scored: list[ScoredSample] = []
    rewards: list[list[float]] = []
    correctness: list[float] = []
    for group, index in zip(batch, indices, strict=True):
        answer = curriculum.pulled[index].question.answer
        group_rewards = [arithmetic_reward(s.text, answer, finished=s.finish_reason == "stop",
                                           tokens=len(s.token_ids)) for s in group.samples]
        rewards.append(group_rewards)
        correctness += [float(correct(s.text, answer)) for s in group.samples]
        for sample, advantage in zip(group.samples, advantages(group_rewards), strict=True):
            scored.append(ScoredSample(sample.prompt_token_ids or [], sample.token_ids,
                                       sample.logprobs or [None] * len(sample.token_ids), advantage))
    return scored, rewards, correctness


@dataclass
class PushLog:
    """The versions this run served, in order, with when each was served and what its push cost."""

    start_version: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.entries.append({"version": self.start_version, "served_at_s": 0.0})

    @property
    def current(self) -> str:
        """The version served now (the last one pushed)."""
        return str(self.entries[-1]["version"])

    def served(self, version: str, push: WeightPush, weight_change: float) -> None:
        """Log that ``version`` is now served everywhere, what its push took, and how far its weights are from
        the first version's (L2 norm)."""
        self.entries.append({"version": version, "served_at_s": time.monotonic() - self._started,
                             "upload_s": push.upload_s, "load_s": push.load_s, "bytes_sent": push.bytes_sent,
                             "relay_chains": push.relay_chains, "weight_change": weight_change})

    def wrong_version_tokens(self, batch: Sequence[GroupResult], indices: Sequence[int],
                             curriculum: Curriculum) -> int:
        """Tokens whose version was not served between their prompt's hand-out and now (unknown ones included)."""
        order = {str(e["version"]): position for position, e in enumerate(self.entries)}
        newest = len(self.entries) - 1
        wrong = 0
        for group, index in zip(batch, indices, strict=True):
            oldest = order[curriculum.pulled[index].version]
            for sample in group.samples:
                wrong += sum(1 for v in sample.token_versions()
                             if v is None or v not in order or not oldest <= order[v] <= newest)
        return wrong


def trace_records(batch: Sequence[GroupResult], indices: Sequence[int], curriculum: Curriculum,
                  rewards: Sequence[Sequence[float]], step: int) -> list[dict[str, Any]]:
    """One trace line per response, as `samrollout replay` and `simulate-rl` read them (meta: step, epoch,
    reward, correctness, version spans; ``finished`` for the clean/all split)."""
    lines = []
    for group, index, group_rewards in zip(batch, indices, rewards, strict=True):
        pull = curriculum.pulled[index]
        for sample_index, (sample, reward) in enumerate(zip(group.samples, group_rewards, strict=True)):
            lines.append({"prompt_id": f"q{pull.question.id}", "sample_index": sample_index,
                          "prompt": pull.question.prompt, "response": sample.text,
                          "prompt_ids": sample.prompt_token_ids, "response_ids": sample.token_ids,
                          "finish_reason": sample.finish_reason, "meta": _meta(sample, pull, reward, step)})
    return lines


def _meta(sample: Sample, pull: Pull, reward: float, step: int) -> dict[str, Any]:
    return {"step": step, "epoch": pull.epoch, "reward": reward, "correct": correct(sample.text, pull.question.answer),
            "finished": sample.finish_reason == "stop",
            "weight_version_spans": [span.model_dump() for span in sample.weight_version_spans]}


def write_traces(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    """The trace file, epoch by epoch (so each prompt's responses are in training order), gzip when ``.gz``."""
    ordered = sorted(lines, key=lambda line: (line["meta"]["epoch"], line["meta"]["step"]))
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for line in ordered:
            handle.write(json.dumps(line) + "\n")


@dataclass(frozen=True)
class StepRecord:
    """What one training step measured: rewards, the time split, the loss, and the version check."""

    step: int
    mean_reward: float
    reward_se: float
    accuracy: float
    samples: int
    tokens: int
    rollout_s: float
    train_s: float
    upload_s: float
    load_s: float
    loss: float
    grad_norm: float
    clipped_share: float
    mean_ratio: float
    wrong_version_tokens: int
    multi_version_samples: int
    version: str
    finished_at: float = field(default_factory=time.time)  # Unix time the step ended (its push served)


def write_plot(path: Path, steps: Sequence[StepRecord], title: str) -> None:
    """Mean reward per step (with its standard error) and each step's time split, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.step for r in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    left.errorbar(x, [r.mean_reward for r in steps], yerr=[r.reward_se for r in steps], marker="o", capsize=2,
                  label="mean reward")
    left.plot(x, [r.accuracy for r in steps], marker=".", linestyle="--", label="share correct")
    left.set(xlabel="step", ylabel="reward", title="reward per step")
    left.legend()
    bottom = [0.0] * len(steps)
    for name in ("rollout_s", "train_s", "upload_s", "load_s"):
        values = [getattr(r, name) for r in steps]
        right.bar(x, values, bottom=bottom, label=name.removesuffix("_s").replace("upload", "push upload"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set(xlabel="step", ylabel="seconds", title="time per step")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
