"""A veRL router that keeps the responses to one prompt on one samrollout server, step after step.

veRL sends each of a prompt's ``n`` responses as its own request, with its own request
id, and its default router spreads them over the least loaded servers.  samrollout drafts
from the responses of a group (the siblings share an automaton), which works only when
the siblings share a server, and from the prompt's responses in earlier steps (each
server keeps its own cross-epoch history), which works only when the prompt comes back
to the same server.  `GroupStickyLoadBalancer` routes by samrollout's one stickiness rule
(`samrollout_client.placement.StickyGroups`): a request id veRL routed before (a later turn
of a multi-turn conversation) goes back to its server; else a response joins its prompt's
siblings while any of them is in flight (keyed by the prompt's token ids); else the prompt
goes to its history-affine server (rendezvous hashing of the prompt's token ids over veRL's
server ids, within 1.25x of a server's share of the requests in flight).  The hash is
deterministic, so a prompt returns to its server in the next step although veRL clears the
sticky caches between steps (`clear_sticky_cache`).  Use it with
``actor_rollout_ref.rollout.router_config_path`` pointing at a YAML file holding
``router_class: samrollout_client.verl.router.GroupStickyLoadBalancer``.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from samrollout_client.placement import StickyGroups
from samrollout_client.protocol.prompt_identity import prompt_id


class GroupStickyLoadBalancer(GlobalRequestLoadBalancer):
    """veRL's sticky balancer, placing by `StickyGroups`: a prompt's first response on its affine server, its
    siblings with it while any is in flight, a known request id on its server.

    ``yaml_config`` (the router YAML) needs no keys beyond ``router_class``; ``max_groups``, which bounded
    a map of finished groups in earlier versions, is accepted and unused (groups are kept while in flight).
    """

    def __init__(self, servers: dict[str, Any], yaml_config: dict[str, Any] | None = None,
                 max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE, full_determinism: bool = False) -> None:
        super().__init__(servers, max_cache_size=max_cache_size, full_determinism=full_determinism)
        self._groups = StickyGroups()

    def require_acquire_fields(self) -> list[str]:
        """The router reads the prompt's token ids when it places a request."""
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        """The request id, so that a group is let go when its last response is done."""
        return ["request_id"]

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None, **_: Any) -> tuple[str, Any]:
        """The request's server by `StickyGroups`, with veRL's in-flight requests as the load (no prompt:
        veRL's own choice)."""
        if not prompt_ids:
            return super().acquire_server(request_id)
        if not self._inflight_requests:
            raise RuntimeError("No available servers in load balancer")
        server_ids = list(self._inflight_requests)
        loads = [self._inflight_requests[server_id] for server_id in server_ids]
        server_id = self._groups.acquire(request_id, prompt_id(prompt_ids), server_ids, loads,
                                         earlier=self._request_id_to_server.get(request_id))
        self._request_id_to_server[request_id] = server_id
        self._inflight_requests[server_id] += 1
        return server_id, self._servers[server_id]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """veRL's release of the server, and of the request's place in its group."""
        super().release_server(server_id, request_id)
        if request_id is not None:
            self._groups.release(request_id)

    def clear_sticky_cache(self) -> dict[str, Any]:
        """Forget sessions and groups (veRL calls this between training and rollout phases); prompts still come
        back to their servers, since the affine choice is a hash of the prompt."""
        self._groups.clear()
        result: dict[str, Any] = super().clear_sticky_cache()
        return result
