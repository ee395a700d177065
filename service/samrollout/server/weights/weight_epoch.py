"""The prefix cache salted by weight load: a request never reuses keys and values computed under earlier weights.

vLLM's prefix cache finds a request's prompt blocks by a hash of their tokens, chained from the
first block, whose hash also covers the request's ``cache_salt``.  Every weight load starts a
new *epoch*, and every request reaching the engine gets the epoch's salt: its blocks can then
match only blocks computed in the same epoch, under the same weights.  Updates that drop the
whole cache (``wait``, ``abort``, ``continue``) need no salt for this; ``continue-keep-kv``
keeps the blocks of the requests in flight, which go on attending to them, and the salt is what
keeps every later request off those blocks and off the cached blocks of requests that finished
under the old weights (which the cache then evicts as it needs room).

The salt is read when a request reaches the engine, so a sequence waiting for admission in the
server (length-aware scheduling) when an update comes gets the new epoch's.  A user's own
``cache_salt`` is kept, the epoch's added to it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from copy import copy
from typing import Any


class WeightEpoch:
    """How many weight loads this server has made: the prefix-cache salt of requests reaching the engine now."""

    def __init__(self) -> None:
        self.loads = 0

    @property
    def salt(self) -> str | None:
        """The salt of requests reaching the engine now; None before the first load (vLLM's own hashing then)."""
        return None if self.loads == 0 else f"samrollout-weights-{self.loads}"

    def advance(self) -> None:
        """A weight load began: requests reaching the engine from now on share no cache block with earlier ones."""
        self.loads += 1


def salted(prompt: Any, salt: str | None) -> Any:
    """``prompt`` (vLLM's prompt dict or `EngineCoreRequest`) with ``salt`` added to its ``cache_salt``; a copy."""
    if salt is None:
        return prompt
    if isinstance(prompt, dict):
        own = prompt.get("cache_salt")
        return {**prompt, "cache_salt": f"{own}|{salt}" if own else salt}
    if hasattr(prompt, "cache_salt"):
        request = copy(prompt)
        request.cache_salt = f"{prompt.cache_salt}|{salt}" if prompt.cache_salt else salt
        return request
    return prompt  # a bare string (vLLM's deprecated form): the serving layer never sends one


class EpochSaltedEngine:
    """The engine, with each request's prompt salted by the weight epoch at the moment it reaches the engine.

    Everything but `generate` goes to the engine itself. ``on_request`` is told of every request
    that reaches the engine (`drafter_stats_cache.EngineActivity` counts them).
    """

    def __init__(self, engine: Any, epoch: WeightEpoch, on_request: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self.epoch = epoch
        self._on_request = on_request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        """The engine's `generate` of ``prompt`` salted when the request is added (its first output is asked for)."""
        if self._on_request is not None:
            self._on_request()
        outputs = self._engine.generate(salted(prompt, self.epoch.salt), sampling_params, request_id, **kwargs)
        async with aclosing(outputs):  # a caller leaving (a client gone) aborts the engine request at once
            async for output in outputs:
                yield output
