"""A veRL router that keeps the responses to one prompt on one samrollout server.

veRL sends each of a prompt's ``n`` responses as its own request, with its own request
id, and its default router spreads them over the least loaded servers.  samrollout drafts
from the responses of a group (the siblings share an automaton), which works only when
the siblings share a server.  `GroupStickyLoadBalancer` routes the first response of a
prompt to the least loaded server and its siblings after it (keyed by the prompt's token
ids, bounded LRU); multi-turn requests keep veRL's request-id stickiness.  Use it with
``actor_rollout_ref.rollout.router_config_path`` pointing at a YAML file holding
``router_class: samrollout_client.verl.router.GroupStickyLoadBalancer``.
"""

from __future__ import annotations

from typing import Any

from cachetools import LRUCache
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from samrollout_client.verl.sampling import group_key


class GroupStickyLoadBalancer(GlobalRequestLoadBalancer):
    """veRL's sticky + least-in-flight balancer, plus: one prompt's responses go to one server."""

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
        """The request's server: its session's, else its prompt group's, else the least loaded."""
        if request_id not in self._request_id_to_server and prompt_ids:
            key = group_key(prompt_ids)
            server_id = self._group_to_server.get(key)
            if server_id is not None and server_id in self._inflight_requests:
                self._request_id_to_server[request_id] = server_id
                self._inflight_requests[server_id] += 1
                return server_id, self._servers[server_id]
            server_id, handle = super().acquire_server(request_id)
            self._group_to_server[key] = server_id
            return server_id, handle
        return super().acquire_server(request_id)

    def clear_sticky_cache(self) -> dict[str, Any]:
        """Forget sessions and groups (veRL calls this between training and rollout phases)."""
        self._group_to_server.clear()
        result: dict[str, Any] = super().clear_sticky_cache()
        return result
