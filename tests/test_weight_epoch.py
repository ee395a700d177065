"""The prefix-cache salt by weight load (samrollout.server.weights.weight_epoch): what each request reaching the
engine gets.

The end-to-end check (a request after a ``continue-keep-kv`` update reuses no block of the old
weights) is in tests/test_weight_update_continue.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from samrollout.server.weights.weight_epoch import EpochSaltedEngine, WeightEpoch, salted


@dataclass
class CoreRequest:
    """What vLLM's `EngineCoreRequest` carries for this: a prompt and its ``cache_salt``."""

    prompt_token_ids: list[int]
    cache_salt: str | None = None


def test_requests_before_any_weight_load_are_not_salted() -> None:
    prompt = {"prompt_token_ids": [1, 2, 3]}
    assert WeightEpoch().salt is None
    assert salted(prompt, WeightEpoch().salt) is prompt


def test_each_weight_load_gives_requests_a_salt_of_its_own_and_keeps_a_users_salt() -> None:
    epoch = WeightEpoch()
    salts = []
    for _ in range(3):
        epoch.advance()
        salts.append(epoch.salt)
    assert len(set(salts)) == 3 and None not in salts
    prompt = {"prompt_token_ids": [1, 2], "cache_salt": "tenant-a"}
    assert salted(prompt, salts[0]) == {"prompt_token_ids": [1, 2], "cache_salt": f"tenant-a|{salts[0]}"}
    assert prompt["cache_salt"] == "tenant-a"  # the caller's prompt is not changed
    assert salted({"prompt_token_ids": [1]}, salts[1])["cache_salt"] == salts[1]
    request = CoreRequest([1, 2])
    assert salted(request, salts[2]).cache_salt == salts[2] and request.cache_salt is None


def test_the_salt_is_the_one_current_when_the_request_reaches_the_engine() -> None:
    class Engine:
        def __init__(self) -> None:
            self.seen: list[Any] = []
            self.name = "engine"

        async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
            self.seen.append(prompt.get("cache_salt"))
            yield request_id

    engine, epoch = Engine(), WeightEpoch()
    salting = EpochSaltedEngine(engine, epoch)

    async def scenario() -> list[str]:
        made = salting.generate({"prompt_token_ids": [1]}, None, "a")  # made before the load, first asked after
        epoch.advance()
        return [output async for output in made]

    assert asyncio.run(scenario()) == ["a"]
    assert engine.seen == [epoch.salt] and salting.name == "engine"
