"""Where the samrollout servers are and how veRL talks to them, read from veRL's rollout config.

veRL ships its rollout config (``actor_rollout_ref.rollout``) to every process, and its
``custom`` dict is the config's extension point; the settings live under
``custom.samrollout``.  Environment variables (``SAMROLLOUT_URLS`` comma-separated,
``SAMROLLOUT_API_KEY``) fill what the config leaves out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from samrollout_client.protocol.modes import IN_FLIGHT_MODES, InFlight

URLS_ENV = "SAMROLLOUT_URLS"
API_KEY_ENV = "SAMROLLOUT_API_KEY"


@dataclass(frozen=True)
class VerlBackendSettings:
    """The samrollout side of a veRL run: server URLs and the knobs of the HTTP mapping."""

    urls: tuple[str, ...]
    api_key: str | None = None
    request_timeout_s: float = 3600.0            # one response may be a 32K-token reasoning trace
    in_flight: InFlight = "abort"  # what a weight push does to requests still running
    shard_megabytes: int = 512                     # safetensors shard size of a weight push (client memory)
    fan_out: bool = True  # a weight push relayed server to server (their --weight-peers): one copy on the link
    sleep_servers: bool = False  # map veRL's sleep/wake to /admin/sleep|wake (servers sharing the trainer's GPUs)
    extra: dict[str, Any] = field(default_factory=dict)  # other fields sent as they are with every request

    def url_for(self, replica_rank: int) -> str:
        """The server of veRL replica ``replica_rank``: the URLs are assigned round-robin."""
        return self.urls[replica_rank % len(self.urls)]


def _section(rollout_config: Any) -> Mapping[str, Any]:
    custom = getattr(rollout_config, "custom", None)
    if custom is None and isinstance(rollout_config, Mapping):
        custom = rollout_config.get("custom")
    section = (custom or {}).get("samrollout") if isinstance(custom, Mapping) or hasattr(custom, "get") else None
    return section or {}


def backend_settings(rollout_config: Any) -> VerlBackendSettings:
    """The settings from ``rollout_config.custom.samrollout``, then the environment; ValueError without URLs."""
    section = _section(rollout_config)
    urls_value = section.get("urls") or os.environ.get(URLS_ENV, "")
    if isinstance(urls_value, str):
        urls = [u.strip() for u in urls_value.split(",") if u.strip()]
    else:
        urls = [str(u).strip() for u in urls_value if str(u).strip()]
    if not urls:
        raise ValueError("samrollout rollout backend: no server URLs; set actor_rollout_ref.rollout.custom.samrollout"
                         f".urls (a list) or {URLS_ENV} (comma-separated), e.g. http://10.0.0.5:8000")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"samrollout rollout backend: server URL {url!r} must start with http:// or https://")
    in_flight = section.get("in_flight", "abort")
    if in_flight not in IN_FLIGHT_MODES:
        allowed = ", ".join(map(repr, IN_FLIGHT_MODES))
        raise ValueError(f"samrollout rollout backend: in_flight must be one of {allowed}, got {in_flight!r}")
    return VerlBackendSettings(
        urls=tuple(u.rstrip("/") for u in urls),
        api_key=section.get("api_key") or os.environ.get(API_KEY_ENV) or None,
        request_timeout_s=float(section.get("request_timeout_s", 3600.0)),
        in_flight=in_flight,
        shard_megabytes=int(section.get("shard_megabytes", 512)),
        fan_out=bool(section.get("fan_out", True)),
        sleep_servers=bool(section.get("sleep_servers", False)),
        extra=dict(section.get("extra") or {}))
