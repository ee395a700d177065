"""The trainer-side end of veRL's weight sync for samrollout: tensors go to the servers over HTTP.

veRL's actor workers hold a "server adapter" (`BaseRollout`) for the rollout backend and,
after each training step, call its ``update_weights`` with a generator of ``(name,
tensor)`` pairs (full HF-named tensors, gathered across the FSDP or Megatron ranks).
Every rank must run through the generator (the gathers are collective); rank 0 streams the
tensors to every samrollout server in safetensors shards and commits them as weight
version ``str(global_steps)`` (`AsyncRolloutClient.push_weights`, which takes the stream).  Nothing is written to a
shared disk.  With tied embeddings the trainer's ``lm_head.weight`` is the embedding
itself and is not sent: a checkpoint of such a model has no such tensor, and the servers
accept exactly the served checkpoint's tensors.  Memory and accelerator moves (``resume``, ``release``) are no-ops: the
servers run on their own accelerators.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.utils import ensure_async_iterator

from samrollout_client.client import AsyncRolloutClient
from samrollout_client.types import WeightPush
from samrollout_client.verl.settings import VerlBackendSettings, backend_settings

logger = logging.getLogger("samrollout_client.verl")


def tied_output_names(model_config: Any) -> frozenset[str]:
    """Tensor names a tied-embeddings model's trainer yields that its checkpoint does not hold."""
    hf_config = getattr(model_config, "hf_config", None)
    return frozenset({"lm_head.weight"}) if getattr(hf_config, "tie_word_embeddings", False) else frozenset()


async def _without(tensors: AsyncIterator[tuple[str, Any]], names: frozenset[str]) -> AsyncIterator[tuple[str, Any]]:
    async for name, tensor in tensors:
        if name not in names:
            yield name, tensor


async def push_to_servers(settings: VerlBackendSettings, tensors: AsyncIterator[tuple[str, Any]], version: str,
                          skipped: frozenset[str] = frozenset()) -> WeightPush:
    """Stream ``tensors`` (less the ``skipped`` names) to every server and serve them as ``version``."""
    async with AsyncRolloutClient(list(settings.urls), model="", api_key=settings.api_key,
                                  request_timeout_s=settings.request_timeout_s) as client:
        push = await client.push_weights(_without(tensors, skipped), version, settings.in_flight,
                                         shard_bytes=settings.shard_megabytes << 20,
                                         timeout_s=settings.request_timeout_s, fan_out=settings.fan_out)
    logger.info("samrollout: weights %s pushed to %d server(s) along %d chain(s): %d bytes in %.2f s", version,
                len(settings.urls), len(push.relay_chains), push.bytes, push.seconds)
    return push


def _is_first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class SamrolloutServerAdapter(BaseRollout):
    """veRL's rollout adapter for samrollout servers: pushes each new policy to them (see the module docstring)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.settings = backend_settings(self.config)
        self.skipped = tied_output_names(self.model_config)
        self.last_push: WeightPush | None = None

    async def resume(self, tags: list[str]) -> None:
        """Nothing: the servers keep their weights and KV cache on their own accelerators."""

    async def release(self) -> None:
        """Nothing (see `resume`)."""

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Stream ``weights`` to every server and serve them as version ``global_steps`` (rank 0 sends)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"samrollout takes full tensors (named_tensors), not {wire_format!r}: "
                                      "use a checkpoint engine backend other than delta_sharded")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("samrollout loads full weights: set actor_rollout_ref.model.lora.merge=True "
                                      "so LoRA is merged before the sync")
        steps = kwargs.get("global_steps")
        version = str(steps) if steps is not None else f"push-{int(time.time())}"
        tensors = ensure_async_iterator(weights)  # type: ignore[no-untyped-call]
        if not _is_first_rank():
            async for _ in tensors:  # the other ranks take part in the gathers and send nothing
                pass
            return
        self.last_push = await push_to_servers(self.settings, tensors, version, self.skipped)
