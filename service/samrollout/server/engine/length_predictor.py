"""Predicted response length per prompt group, learned only from what rollouts reveal.

Length-aware scheduling (`admission`) starts the groups expected to run longest first.
What a group's length is predicted from, in this order of trust:

- its finished siblings (mean output length);
- its running siblings (tokens generated so far: a lower bound on the group's length);
- earlier rollouts of the same prompt (an LRU table keyed by the prompt's identity,
  `samrollout_client.protocol.prompt_identity`, bounded by ``history_prompts`` entries; kept across
  weight updates, since it only orders requests).

Never from ``max_tokens``: trainers send one cap for every request, so it says nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from samrollout_client.protocol.prompt_identity import prompt_id

# Weight of the newest rollout's group mean in a prompt's remembered length (exponential moving average).
HISTORY_WEIGHT = 0.5


def prompt_key(prompt_token_ids: Sequence[int] | None, fallback: str) -> str:
    """A prompt's key: its identity (`samrollout_client.protocol.prompt_identity.prompt_id` of its token ids), or
    ``fallback`` when it has none."""
    if not prompt_token_ids:
        return fallback
    return prompt_id(prompt_token_ids)


@dataclass
class GroupLengths:
    """What one group (siblings of one prompt) has shown so far in this rollout."""

    prompt: str
    finished: list[int] = field(default_factory=list)
    running: set[str] = field(default_factory=set)   # child ids in the engine now
    started: int = 0                                 # children admitted so far (running or finished)


class LengthPredictor:
    """Per-group length estimates from finished and running siblings and from earlier rollouts."""

    def __init__(self, history_prompts: int = 4096) -> None:
        if history_prompts < 0:
            raise ValueError(f"history_prompts must be >= 0, got {history_prompts}")
        self.history_prompts = history_prompts
        self.groups: dict[str, GroupLengths] = {}
        self._history: OrderedDict[str, float] = OrderedDict()

    def group(self, group: str, prompt: str) -> GroupLengths:
        """The group's record (made on first sight)."""
        record = self.groups.get(group)
        if record is None:
            record = self.groups[group] = GroupLengths(prompt)
        return record

    def started(self, group: str, child: str) -> None:
        """``child`` of ``group`` entered the engine."""
        record = self.groups[group]
        record.running.add(child)
        record.started += 1

    def finished(self, group: str, child: str, output_tokens: int | None) -> None:
        """``child`` left the engine; ``output_tokens`` is its length (a lower bound if cut short), or None."""
        record = self.groups.get(group)
        if record is None:
            return
        record.running.discard(child)
        if output_tokens is not None:
            record.finished.append(output_tokens)

    def forget_if_idle(self, group: str, waiting: int) -> None:
        """Once nothing of a group runs or waits, fold its mean length into the history and drop it."""
        record = self.groups.get(group)
        if record is not None and not record.running and waiting == 0:
            del self.groups[group]
            if record.finished:
                self._remember(record.prompt, sum(record.finished) / len(record.finished))

    def history(self, prompt: str) -> float | None:
        """The remembered mean length of responses to ``prompt`` from earlier rollouts."""
        return self._history.get(prompt)

    def predict(self, group: str, progress: Callable[[str], int]) -> float | None:
        """The group's expected response length, or None when nothing is known yet.

        ``progress(child)`` is how many tokens a running child has generated so far.
        """
        record = self.groups.get(group)
        if record is None:
            return None
        lower = max((progress(child) for child in record.running), default=0)
        if record.finished:
            return max(sum(record.finished) / len(record.finished), float(lower))
        remembered = self._history.get(record.prompt)
        if remembered is not None:
            return max(remembered, float(lower))
        return float(lower) if record.running else None

    def _remember(self, prompt: str, mean_length: float) -> None:
        if self.history_prompts == 0:
            return
        old = self._history.pop(prompt, None)
        self._history[prompt] = mean_length if old is None else (
            HISTORY_WEIGHT * mean_length + (1 - HISTORY_WEIGHT) * old)
        while len(self._history) > self.history_prompts:
            self._history.popitem(last=False)

    def history_size(self) -> int:
        """Prompts remembered from earlier rollouts."""
        return len(self._history)
