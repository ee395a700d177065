"""Responses of earlier rollouts, per prompt: the cross-epoch source of drafts.

RL revisits the same prompts every epoch, and a policy's responses to a prompt change
slowly between weight updates, so an earlier epoch's responses are good drafting text for
the next one (Seer's observation, across steps instead of within a group).  They are only
drafts: verification keeps outputs exact, so the history is kept across weight updates.

The store is keyed by the prompt's identity (its token ids' 128-bit digest,
`samrollout_client.protocol.prompt_identity.prompt_digest`), not by group ids, which trainers often
renew every step.  It is bounded twice: at most
``responses_per_prompt`` responses per prompt (the newest), and at most ``max_tokens``
response tokens in all, evicting the least recently used prompts first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import numpy.typing as npt

from samrollout.tokens import Int32Array, as_token_array


class ResponseHistory:
    """An LRU store of earlier responses per prompt, bounded by responses per prompt and by tokens."""

    def __init__(self, max_tokens: int, responses_per_prompt: int) -> None:
        if max_tokens < 0 or responses_per_prompt < 1:
            raise ValueError("max_tokens must be >= 0 and responses_per_prompt >= 1")
        self.max_tokens = max_tokens
        self.responses_per_prompt = responses_per_prompt
        self._prompts: OrderedDict[bytes, OrderedDict[Hashable, Int32Array]] = OrderedDict()
        self._tokens = 0

    def record(self, key: bytes, response_id: Hashable, response: Sequence[int] | npt.NDArray[Any]) -> None:
        """Keep ``response`` (to the prompt with ``key``) under ``response_id``; the same id again replaces
        it (a preempted request that resumes, then finishes, is one response)."""
        tokens = as_token_array(response, "response").copy()
        if len(tokens) == 0 or len(tokens) > self.max_tokens:
            return
        responses = self._prompts.setdefault(key, OrderedDict())
        self._prompts.move_to_end(key)
        old = responses.pop(response_id, None)
        if old is not None:
            self._tokens -= len(old)
        responses[response_id] = tokens
        self._tokens += len(tokens)
        while len(responses) > self.responses_per_prompt:
            self._tokens -= len(responses.popitem(last=False)[1])
        while self._tokens > self.max_tokens:
            self._evict_one()

    def responses(self, key: bytes, exclude: Hashable | None = None) -> list[Int32Array]:
        """The kept responses to the prompt with ``key``, oldest first (``exclude``: one id to leave out)."""
        responses = self._prompts.get(key)
        if responses is None:
            return []
        self._prompts.move_to_end(key)
        return [tokens for response_id, tokens in responses.items() if response_id != exclude]

    @property
    def tokens(self) -> int:
        """Response tokens held now."""
        return self._tokens

    @property
    def prompts(self) -> int:
        """Prompts with at least one kept response."""
        return len(self._prompts)

    def _evict_one(self) -> None:
        """Drop the least recently used prompt's oldest response (the prompt with its last)."""
        key, responses = next(iter(self._prompts.items()))
        self._tokens -= len(responses.popitem(last=False)[1])
        if not responses:
            del self._prompts[key]
