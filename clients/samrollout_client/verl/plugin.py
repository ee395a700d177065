"""Registers samrollout with veRL; veRL imports this module through its ``verl.plugins`` entry point.

Importing it adds the rollout name ``samrollout`` to veRL's replica registry (the
trainer's `LLMServerManager` builds `SamrolloutReplica` for it) and to its server-adapter
table (the actor workers build `SamrolloutServerAdapter`, which receives each weight
sync).  Both are looked up lazily, so importing veRL stays as cheap as it was.
"""

from __future__ import annotations

from typing import Any

ROLLOUT_NAME = "samrollout"
ADAPTER_CLASS = "samrollout_client.verl.adapter.SamrolloutServerAdapter"


def _load_replica() -> type[Any]:
    from samrollout_client.verl.replica import SamrolloutReplica

    return SamrolloutReplica


def register() -> None:
    """Make ``actor_rollout_ref.rollout.name=samrollout`` known to veRL (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_CLASS


register()
