"""The trainer half of the CPU GRPO example: a causal LM in transformers, GRPO's loss, and the weights to push.

`GrpoPolicy` holds the policy (float32 on the CPU) and its optimizer. `GrpoPolicy.train_step`
takes scored samples as samrollout returned them (prompt and response token ids, and each
response token's logprob under the weights that sampled it) and takes one clipped
policy-gradient step (PPO's clipped surrogate, GRPO's group-normalised advantages, token-mean
over the batch as DAPO does). The sampler's logprob is the behaviour policy's for *that token*:
a response that spans weight versions (a `continue` update ran while it generated) weighs each
token by ``exp(logp_now - logp_sampled)`` against the version that sampled it, clipped to
``[1 - clip, 1 + clip]``. `GrpoPolicy.served_state` is the state dict to push: the served
checkpoint's tensor names, shapes and dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class ScoredSample:
    """One response to train on: its token ids, the sampler's logprob of each, and its GRPO advantage."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    sampled_logprobs: Sequence[float | None]
    advantage: float


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step saw: the loss, the gradient norm, how far the weights moved from the sampler's."""

    loss: float
    grad_norm: float
    tokens: int
    clipped_share: float
    mean_ratio: float


def weight_distance(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    """The L2 norm of ``first - second`` over every tensor they share: how far apart two sets of weights are."""
    return float(sum(((first[name].float() - second[name].float()) ** 2).sum() for name in first)) ** 0.5


def checkpoint_dtypes(model_dir: Path) -> dict[str, torch.dtype]:
    """The served checkpoint's tensors by name, with their dtypes (read from its ``*.safetensors`` headers)."""
    dtypes: dict[str, torch.dtype] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                dtypes[name] = _DTYPES[handle.get_slice(name).get_dtype()]
    if not dtypes:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return dtypes


class GrpoPolicy:
    """The policy being trained, its AdamW optimizer, and GRPO's clipped policy-gradient step."""

    def __init__(self, model_dir: Path, *, lr: float, clip: float = 0.2, micro_batch: int = 16) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.clip, self.micro_batch = clip, micro_batch
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self._served = checkpoint_dtypes(model_dir)
        missing = set(self._served) - set(self.model.state_dict())
        if missing:
            raise ValueError(f"the checkpoint has tensors the model does not: {sorted(missing)[:5]}")

    def served_state(self) -> dict[str, torch.Tensor]:
        """The weights to push: every tensor of the served checkpoint, by its name, in its dtype."""
        state = self.model.state_dict()
        return {name: state[name].detach().to(dtype, copy=True).contiguous() for name, dtype in self._served.items()}

    def train_step(self, samples: Sequence[ScoredSample]) -> StepStats:
        """One clipped policy-gradient step over ``samples`` (micro-batched, token-mean loss); samples whose
        advantage is 0 (their group's rewards all tie) carry no gradient and are skipped."""
        live = [s for s in samples if s.advantage != 0.0 and len(s.response_ids) > 0]
        tokens = sum(len(s.response_ids) for s in live)
        self.optimizer.zero_grad(set_to_none=True)
        if not live:
            return StepStats(loss=0.0, grad_norm=0.0, tokens=0, clipped_share=0.0, mean_ratio=1.0)
        loss_sum = clipped = ratio_sum = 0.0
        for start in range(0, len(live), self.micro_batch):
            part = self._surrogate(live[start:start + self.micro_batch], tokens)
            part.loss.backward()
            loss_sum, clipped, ratio_sum = loss_sum + part.loss.item(), clipped + part.clipped, ratio_sum + part.ratio
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        return StepStats(loss=loss_sum, grad_norm=grad_norm if math.isfinite(grad_norm) else float("nan"),
                         tokens=tokens, clipped_share=clipped / tokens, mean_ratio=ratio_sum / tokens)

    def _surrogate(self, samples: Sequence[ScoredSample], total_tokens: int) -> _Surrogate:
        """PPO's clipped surrogate over ``samples``' response tokens, divided by the whole batch's token count."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        width = max(lengths)
        ids = torch.zeros((len(samples), width), dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        mask = torch.zeros((len(samples), width - 1))
        old = torch.zeros((len(samples), width - 1))
        advantage = torch.zeros((len(samples), 1))
        for row, sample in enumerate(samples):
            prompt, response = list(sample.prompt_ids), list(sample.response_ids)
            ids[row, :lengths[row]] = torch.tensor(prompt + response)
            attention[row, :lengths[row]] = 1
            first = len(prompt) - 1  # the logits at position t predict token t + 1
            mask[row, first:first + len(response)] = 1.0
            behaviour = [0.0 if value is None else value for value in sample.sampled_logprobs]
            old[row, first:first + len(response)] = torch.tensor(behaviour[:len(response)])
            advantage[row, 0] = sample.advantage
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp((logp - old) * mask)
        clipped_ratio = ratio.clamp(1.0 - self.clip, 1.0 + self.clip)
        surrogate = torch.minimum(ratio * advantage, clipped_ratio * advantage)
        loss = -(surrogate * mask).sum() / total_tokens
        was_clipped = ((ratio != clipped_ratio).float() * mask).sum().item()
        return _Surrogate(loss, was_clipped, float((ratio.detach() * mask).sum()))


@dataclass(frozen=True)
class _Surrogate:
    loss: torch.Tensor
    clipped: float
    ratio: float
