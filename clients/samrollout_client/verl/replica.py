"""veRL's rollout replica for samrollout: a running samrollout server instead of an engine veRL launches.

veRL builds one `RolloutReplica` per slice of its rollout world and asks it to start its
servers (``init_hybrid`` on the trainer's workers, ``init_colocated``, or
``init_standalone`` on a new resource pool).  A samrollout server runs apart from the
trainer, on its own accelerators, so every mode here does the same thing: connect replica
``r`` to URL ``r mod len(urls)`` through one `SamrolloutServer` Ray actor, which uses no GPU.
That actor is also the replica's only "worker" for veRL's checkpoint-engine weight sync
(`samrollout_client.verl.checkpoint_engine`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from samrollout_client.verl.server_actor import SamrolloutServer
from samrollout_client.verl.settings import backend_settings


class SamrolloutReplica(RolloutReplica):
    """One veRL rollout replica served by a samrollout server (see the module docstring)."""

    def __init__(self, replica_rank: int, config: Any, model_config: Any, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = "") -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        self.settings = backend_settings(self.config)
        self.url = self.settings.url_for(replica_rank)

    async def init_hybrid(self, worker_group: Any) -> None:
        """The trainer's workers stay trainers: connect to the samrollout server."""
        await self._connect()

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        """As `init_hybrid`."""
        await self._connect()

    async def init_colocated(self, resource_pool: Any) -> None:
        """As `init_hybrid`: no rollout workers are placed on the pool."""
        await self._connect()

    async def init_standalone(self) -> None:
        """Connect to the samrollout server; no resource pool is created (the server owns its accelerators)."""
        await self._connect()

    async def launch_servers(self) -> None:
        """Connect (veRL calls this from the base class's init methods)."""
        await self._connect()

    def rollout_worker_use_gpu(self) -> bool:
        """The replica's only process is an HTTP forwarder."""
        return False

    async def _connect(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        actor_cls: Any = ray.remote(num_cpus=0)(SamrolloutServer)
        server: Any = actor_cls.options(max_concurrency=self.max_concurrency).remote(
            self.settings, self.url, prompt_length=int(self.config.prompt_length),
            response_length=int(self.config.response_length), replica_rank=self.replica_rank,
            seed=int(self.config.seed) if getattr(self.config, "full_determinism", False) else None)
        self._server_address = await server.connect.remote()
        self.servers = [server]
        self._server_handle = server
        # veRL's checkpoint-engine weight sync (the fully-async trainer) groups the replicas' workers; the
        # server actor stands in for them (its update_weights and execute_checkpoint_engine do nothing).
        self.workers = [server]

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """Abort one response wherever it runs."""
        calls = (server.abort_request.remote(request_id) for server in self.servers)
        results: list[dict[str, Any]] = await asyncio.gather(*calls)
        for result in results:
            if result.get("aborted"):
                return dict(result)
        return {"aborted": False, "request_id": request_id, "error": "request not found on any server"}
