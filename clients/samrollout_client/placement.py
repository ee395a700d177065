"""Which endpoint a prompt group goes to: by outstanding requests, or by predicted work.

``least-outstanding`` (the default) sends each group to the endpoint with the fewest
requests in flight from this client.  ``predicted-work`` remembers how long the responses
to each prompt were in earlier rollouts (`LengthHistory`, LRU-bounded) and places the
groups longest first, each onto the endpoint with the least predicted work (tokens)
assigned so far: the longest-processing-time rule, so that no endpoint is left alone with
the long groups at the end of a step.  Prompts never seen before count as the mean of the
known ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from samrollout_client.prompt_identity import prompt_id

Placement = Literal["least-outstanding", "predicted-work"]
PLACEMENTS: tuple[Placement, ...] = ("least-outstanding", "predicted-work")


class LengthHistory:
    """Mean response length per prompt from earlier rollouts, for at most ``max_prompts`` prompts (LRU).

    Prompts are told apart by their identity (`samrollout_client.prompt_identity`): a prompt given as text
    and the same prompt given as token ids are two prompts here.
    """

    def __init__(self, max_prompts: int = 65536) -> None:
        if max_prompts < 1:
            raise ValueError(f"max_prompts must be at least 1, got {max_prompts}")
        self.max_prompts = max_prompts
        self._lengths: OrderedDict[str, float] = OrderedDict()

    def record(self, prompt: str | list[int], lengths: Sequence[int]) -> None:
        """Remember the mean of ``lengths`` (one group's responses, in tokens) for ``prompt``."""
        if not lengths:
            return
        key = prompt_id(prompt)
        self._lengths.pop(key, None)
        self._lengths[key] = sum(lengths) / len(lengths)
        while len(self._lengths) > self.max_prompts:
            self._lengths.popitem(last=False)

    def predict(self, prompt: str | list[int]) -> float | None:
        """The remembered mean length of ``prompt``'s responses, or None."""
        return self._lengths.get(prompt_id(prompt))

    def __len__(self) -> int:
        return len(self._lengths)


def place_by_predicted_work(predicted: Sequence[float | None], endpoints: int,
                            load: Sequence[float] | None = None) -> list[int]:
    """An endpoint index per group: longest predicted group first, onto the least loaded endpoint.

    ``predicted`` is each group's predicted work (None: unknown, counted as the mean of the
    known ones, or 1 when none is known); ``load`` is work already on each endpoint.
    """
    if endpoints < 1:
        raise ValueError("at least one endpoint is needed")
    known = [p for p in predicted if p is not None]
    default = sum(known) / len(known) if known else 1.0
    work = [default if p is None else p for p in predicted]
    totals = list(load) if load is not None else [0.0] * endpoints
    chosen = [0] * len(work)
    for group in sorted(range(len(work)), key=lambda g: (-work[g], g)):
        target = min(range(endpoints), key=lambda e: (totals[e], e))
        chosen[group] = target
        totals[target] += work[group]
    return chosen
