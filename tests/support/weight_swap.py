"""Swap the shared tiny server between the tiny model's two weight sets, and put it back after; what a push did.

Modules that test weight updates on the session's tiny server flip it between its own weights
and a second set; other modules compare that server with others at one version, so each swapping
module must leave it as it found it: the original weights under the version served before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess


class WeightSwapper:
    """The two weight sets and which one the server has loaded; tests update the server with `next_dir`."""

    def __init__(self, prefix: str, original: Path, other: Path) -> None:
        self.prefix, self.original, self.other = prefix, original, other
        self.loaded = original
        self.count = 0

    def next_dir(self) -> Path:
        """The weights an update should load: the ones not served now (set `loaded` once it succeeds)."""
        return self.other if self.loaded == self.original else self.original

    def new_version(self, name: str) -> str:
        """A version name not used before in this session."""
        self.count += 1
        return f"{self.prefix}-{name}-{self.count}"


@contextlib.contextmanager
def swapping_weights(server: ServerProcess, prefix: str, original: Path, other: Path) -> Iterator[WeightSwapper]:
    """A `WeightSwapper` for ``server``; after, the original weights are back under the version served before
    (reloaded whenever either differs: an even number of swaps leaves the weights but not the version)."""
    start_version = admin_status(server)["weight_version"]
    swapper = WeightSwapper(prefix, original, other)
    yield swapper
    if swapper.loaded != original or admin_status(server)["weight_version"] != start_version:
        reply = httpx.post(f"{server.url}/admin/update_weights", headers={"Authorization": f"Bearer {API_KEY}"},
                           timeout=300, json={"path": str(original), "version": start_version, "in_flight": "wait"})
        assert reply.status_code == 200, reply.text


def swapped_pair(prefix: str) -> Any:
    """A module fixture ``swaps``: `tiny_server` and `second_tiny_server` each a `WeightSwapper` (a push to both),
    each left after the module on the weights and version it had."""

    @pytest.fixture(scope="module", name="swaps")
    def swaps(tiny_server: ServerProcess, second_tiny_server: ServerProcess, tiny_dir: Path,
              tiny_weights_v2: Path) -> Iterator[tuple[WeightSwapper, WeightSwapper]]:
        with swapping_weights(tiny_server, prefix, tiny_dir, tiny_weights_v2) as first, \
                swapping_weights(second_tiny_server, prefix, tiny_dir, tiny_weights_v2) as second:
            yield first, second

    return swaps


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def greedy(server: ServerProcess, prompt: str) -> tuple[list[int], str]:
    """The server's greedy 12 tokens for ``prompt`` and the version that made them: which weights it serves."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    return result["choices"][0]["token_ids"], result["weight_version"]


def open_uploads(server: ServerProcess) -> list[dict[str, Any]]:
    """The server's open weight uploads."""
    reply = httpx.get(f"{server.url}/admin/weight_uploads", headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    uploads: list[dict[str, Any]] = reply.json()["uploads"]
    return uploads


def server_id(server: ServerProcess) -> str:
    """The id the server drew at start (how relays name it)."""
    found: str = httpx.get(f"{server.url}/admin/identity", headers=AUTH, timeout=60).json()["server_id"]
    return found
