"""A veRL router that keeps the responses to one prompt on one samrollout server, step after step.

veRL sends each of a prompt's ``n`` responses as its own request, with its own request
id, and its default router spreads them over the least loaded servers.  samrollout drafts
from the responses of a group (the siblings share an automaton), which works only when
the siblings share a server, and from the prompt's responses in earlier steps (each
server keeps its own cross-epoch history), which works only when the prompt comes back
to the same server.  `GroupStickyLoadBalancer` routes the first response of a prompt by
history-affine placement (`samrollout_client.placement.place_affine`: rendezvous hashing
of the prompt's token ids over veRL's server ids, within 1.25x of a server's share of the
requests in flight) and its siblings after it (keyed by the prompt's token ids, bounded
LRU); multi-turn requests keep veRL's request-id stickiness.  The hash is deterministic,
so a prompt returns to its server in the next step although veRL clears the sticky
caches between steps (`clear_sticky_cache`).  Use it with
``actor_rollout_ref.rollout.router_config_path`` pointing at a YAML file holding
``router_class: samrollout_client.verl.router.GroupStickyLoadBalancer``.
"""

from __future__ import annotations

from typing import Any

from cachetools import LRUCache
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from samrollout_client.placement import place_affine
from samrollout_client.protocol.prompt_identity import prompt_id
from samrollout_client.verl.sampling import group_key


class GroupStickyLoadBalancer(GlobalRequestLoadBalancer):
    """veRL's sticky balancer, plus: a prompt's first response goes to its affine server, its siblings follow it."""

    def __init__(self, servers: dict[str, Any], yaml_config: dict[str, Any] | None = None,
                 max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE, full_determinism: bool = False) -> None:
        size = int((yaml_config or {}).get("max_groups", max_cache_size))
        super().__init__(servers, max_cache_size=max_cache_size, full_determinism=full_determinism)
        self._group_to_server: LRUCache[str, str] = LRUCache(maxsize=size)

    def require_acquire_fields(self) -> list[str]:
        """The router reads the prompt's token ids when it places a request."""
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        """Releases count by server, as in veRL's balancer."""
        return []

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None, **_: Any) -> tuple[str, Any]:
        """The request's server: its session's, else its prompt group's, else the prompt's affine server."""
        if request_id in self._request_id_to_server or not prompt_ids:
            return super().acquire_server(request_id)
        key = group_key(prompt_ids)
        server_id = self._group_to_server.get(key)
        if server_id is None or server_id not in self._inflight_requests:
            server_id = self.affine_server(prompt_ids)
            self._group_to_server[key] = server_id
        self._request_id_to_server[request_id] = server_id
        self._inflight_requests[server_id] += 1
        return server_id, self._servers[server_id]

    def affine_server(self, prompt_ids: list[int]) -> str:
        """The server for a new group of ``prompt_ids``: its rendezvous choice within the load bound, veRL's
        in-flight requests as the load (`samrollout_client.placement.place_affine`)."""
        if not self._inflight_requests:
            raise RuntimeError("No available servers in load balancer")
        server_ids = list(self._inflight_requests)
        loads = [self._inflight_requests[server_id] for server_id in server_ids]
        return server_ids[place_affine(prompt_id(prompt_ids), server_ids, loads)]

    def clear_sticky_cache(self) -> dict[str, Any]:
        """Forget sessions and groups (veRL calls this between training and rollout phases); prompts still come
        back to their servers, since the affine choice is a hash of the prompt."""
        self._group_to_server.clear()
        result: dict[str, Any] = super().clear_sticky_cache()
        return result
