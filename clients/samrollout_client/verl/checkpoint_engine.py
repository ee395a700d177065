"""samrollout as a veRL checkpoint engine: the weight sync of veRL's fully-async trainer, over HTTP.

veRL's fully-async trainer (``verl.experimental.fully_async_policy``) syncs weights through
``CheckpointEngineManager.update_weights``: every actor worker calls its checkpoint engine's
``send_weights`` with the ``(name, tensor)`` generator of the new policy, while each rollout
replica's workers receive.  A samrollout server needs no receiving side: rank 0 streams the
tensors to every server over HTTP (`push_to_servers`, as `SamrolloutServerAdapter` does in
the synchronous trainer) and commits them as weight version ``str(global_steps)``; the
other ranks run through the generator (its gathers are collective) and send nothing.  The
replicas' "worker" is their server actor, whose ``update_weights`` and
``execute_checkpoint_engine`` do nothing.

Select it with ``actor_rollout_ref.rollout.checkpoint_engine.backend=samrollout`` and
``custom_backend_module=samrollout_client.verl.checkpoint_engine``; its settings are
``checkpoint_engine.engine_kwargs.samrollout``: ``urls`` (else ``SAMROLLOUT_URLS``),
``api_key`` (else ``SAMROLLOUT_API_KEY``), ``in_flight`` (default ``"continue"``: running
responses carry on across the update), ``shard_megabytes``, ``request_timeout_s``, ``fan_out``
(default true: each file crosses the trainer's link once and the servers relay it to their
``--weight-peers``) and ``tie_word_embeddings`` (true for a tied-embeddings model: its ``lm_head.weight`` is not sent).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Generator
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from samrollout_client.types import WeightPush
from samrollout_client.verl.adapter import push_to_servers
from samrollout_client.verl.settings import VerlBackendSettings, backend_settings

BACKEND = "samrollout"
_SETTING_KEYS = ("urls", "api_key", "in_flight", "shard_megabytes", "request_timeout_s", "fan_out")


def engine_settings(engine_kwargs: dict[str, Any]) -> VerlBackendSettings:
    """The push settings from ``engine_kwargs`` (then the environment); ``in_flight`` defaults to ``"continue"``."""
    section = {key: engine_kwargs[key] for key in _SETTING_KEYS if engine_kwargs.get(key) is not None}
    section.setdefault("in_flight", "continue")
    return backend_settings({"custom": {"samrollout": section}})


@CheckpointEngineRegistry.register(BACKEND)
class SamrolloutCheckpointEngine(CheckpointEngine):
    """veRL's checkpoint engine ``samrollout``: rank 0 pushes the weights to the servers (see the module docstring)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.bucket_size, self.is_master = bucket_size, is_master
        self.settings = engine_settings(engine_kwargs)
        tied = bool(engine_kwargs.get("tie_word_embeddings", False))
        self.skipped: frozenset[str] = frozenset({"lm_head.weight"}) if tied else frozenset()
        self.last_push: WeightPush | None = None

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate: the tensors go out over HTTP as they are read."""
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group: no arguments for either side's ``init_process_group``."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Nothing (see `build_topology`)."""

    def finalize(self) -> None:
        """Nothing (see `prepare`)."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Run through ``weights`` on every rank; rank 0 pushes them to every server as ``str(global_steps)``."""
        version = str(global_steps) if global_steps is not None else f"push-{int(time.time())}"
        tensors: AsyncIterator[tuple[str, Any]] = ensure_async_iterator(weights)  # type: ignore[no-untyped-call]
        if not self.is_master:
            async for _ in tensors:  # the other ranks take part in the gathers and send nothing
                pass
            return {}
        self.last_push = await push_to_servers(self.settings, tensors, version, self.skipped)
        return {"samrollout/weight_push_bytes": self.last_push.bytes,
                "samrollout/weight_push_bytes_sent": self.last_push.bytes_sent,
                "samrollout/weight_push_seconds": self.last_push.seconds}

    async def receive_weights(self, global_steps: int | None = None) -> Generator[tuple[str, Any], None, None]:
        """Never used: the servers receive the weights over HTTP, not through a checkpoint engine."""
        raise NotImplementedError("the samrollout checkpoint engine only sends: the servers take the weights "
                                  "over HTTP")
