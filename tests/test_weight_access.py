"""Only the trainer changes the policy: AReaL's routes beside an API key, and loads by path confined to a root.

One real server (the tiny model) runs AReaL's routes with an API key, the trainer's own port
(``--areal-port``) and ``--weights-root``; it names `tiny_server`, whose key differs, as its weight
peer.  A caller without the key can load, upload, commit, pause, sleep or read the API docs on
neither port; on the trainer's port AReaL's routes and ``/v1/completions`` answer without it, as
AReaL's protocol wants.  A load by path outside the root (a path elsewhere, ``..``, a link to a
directory or to a file elsewhere, a path that does not exist) is a 403 naming the setting, the
same whatever is there; inside the root it loads.  The peer that refuses this server's key is
reported as a configuration error.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open

from conftest import TINY_CONTEXT, TINY_SERVER_MEMORY, peer_url, server_fixture
from samrollout.testing import ServerProcess, free_port
from support.frozen_engine import until

KEY = "trainer-port-key"  # not the session's API_KEY: its peer tiny_server refuses it
AUTH = {"Authorization": f"Bearer {KEY}"}
TRAINER_PORT = free_port()
TRAINER = f"http://127.0.0.1:{TRAINER_PORT}"
ROOT = Path(tempfile.gettempdir()) / f"samrollout-test-weights-root-{os.getpid()}"
PROBE = {"model": "tiny", "prompt": "who may load weights", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def access_server_args(tiny_dir: Path) -> list[str]:
    """AReaL's routes with a key, the trainer's port and a weights root; `tiny_server` (another key) as its peer."""
    ROOT.mkdir(exist_ok=True)
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", KEY, "--areal-routes",
            "--areal-port", str(TRAINER_PORT), "--weights-root", str(ROOT), "--weight-peers", peer_url("tiny_server"),
            "--max-model-len", str(TINY_CONTEXT), "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


access_server = server_fixture("access_server", access_server_args)


@dataclass(frozen=True)
class Layout:
    """Weights inside the root (the served ones, and others), and ways out of it."""

    original: Path  # the tiny model's weights, inside the root
    other: Path     # other weights, inside the root
    outside: Path   # other weights, outside the root
    ways_out: dict[str, str]  # how a path leads outside -> the path


@pytest.fixture(scope="module")
def layout(access_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    outside = tmp_path_factory.mktemp("outside") / "weights"
    shutil.copytree(tiny_weights_v2, outside)
    original, other = ROOT / "original", ROOT / "weight_update_v7"
    shutil.copytree(tiny_dir, original)
    shutil.copytree(tiny_weights_v2, other)
    (ROOT / "link-out").symlink_to(outside, target_is_directory=True)
    file_out = ROOT / "file-out"
    shutil.copytree(tiny_dir, file_out)
    (file_out / "model.safetensors").unlink()
    (file_out / "model.safetensors").symlink_to(outside / "model.safetensors")
    ways_out = {"a directory elsewhere": str(outside),
                "..": f"{ROOT}/original/../../{os.path.relpath(outside, ROOT.parent)}",
                "a link to a directory elsewhere": str(ROOT / "link-out"),
                "a path that does not exist": str(outside.parent / "no-such-weights"),
                "a system directory": "/etc",
                "a relative path": os.path.relpath(outside, os.getcwd())}
    yield Layout(original, other, outside, ways_out)
    shutil.rmtree(ROOT, ignore_errors=True)


def _tensor_names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def _version(base: str) -> str:
    version: str = httpx.get(f"{base}/health", timeout=60).json()["weight_version"]
    return version


def test_without_the_key_no_caller_loads_uploads_commits_pauses_sleeps_or_reads_the_docs_on_either_port(
        access_server: ServerProcess, layout: Layout) -> None:
    before = _version(access_server.url)
    opened = httpx.post(f"{access_server.url}/admin/weight_uploads", headers=AUTH, timeout=60)
    assert opened.status_code == 201, opened.text
    upload = opened.json()["upload_id"]
    data = (layout.other / "model.safetensors").read_bytes()
    try:
        for base in (access_server.url, TRAINER):
            refused = {
                "load by path": httpx.post(f"{base}/admin/update_weights", timeout=60,
                                           json={"path": str(layout.other), "version": "stolen"}),
                "open an upload": httpx.post(f"{base}/admin/weight_uploads", timeout=60),
                "upload a file": httpx.put(f"{base}/admin/weight_uploads/{upload}/files/model.safetensors",
                                           content=data, timeout=60),
                "commit": httpx.post(f"{base}/admin/weight_uploads/{upload}/commit", timeout=60,
                                     json={"version": "stolen"}),
                "pause": httpx.post(f"{base}/admin/pause", timeout=60),
                "sleep": httpx.post(f"{base}/admin/sleep", timeout=60),
                "status": httpx.get(f"{base}/admin/status", timeout=60),
                "docs": httpx.get(f"{base}/docs", timeout=60),
                "schema": httpx.get(f"{base}/openapi.json", timeout=60),
                "redoc": httpx.get(f"{base}/redoc", timeout=60),
                "chat": httpx.post(f"{base}/v1/chat/completions", timeout=60,
                                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
                "models": httpx.get(f"{base}/v1/models", timeout=60),
            }
            if base == access_server.url:  # AReaL's names and completions need the key everywhere but the trainer's
                refused |= {
                    "AReaL's load": httpx.post(f"{base}/areal_update_weights", timeout=60,
                                               json={"model_path": str(layout.other)}),
                    "AReaL's pause": httpx.post(f"{base}/areal_pause_generation", json={}, timeout=60),
                    "AReaL's sleep": httpx.post(f"{base}/sleep", timeout=60),
                    "completions": httpx.post(f"{base}/v1/completions", json=PROBE, timeout=60)}
            for what, reply in refused.items():
                assert reply.status_code == 401, (base, what, reply.text)
                assert reply.json()["error"]["type"] == "AuthenticationError", (base, what)
        shown = httpx.get(f"{access_server.url}/admin/weight_uploads/{upload}", headers=AUTH, timeout=60).json()
        assert shown["files"] == {}  # nothing was staged
        assert _version(access_server.url) == before
        assert httpx.post(f"{access_server.url}/v1/completions", json=PROBE, headers=AUTH,
                          timeout=60).status_code == 200  # still serving
    finally:
        httpx.delete(f"{access_server.url}/admin/weight_uploads/{upload}", headers=AUTH, timeout=60)
        httpx.post(f"{TRAINER}/areal_continue_generation", timeout=60)  # had a pause got through: serving again


def test_the_trainers_port_answers_areals_routes_and_completions_without_a_key(access_server: ServerProcess) -> None:
    """What AReaL sends, without a key: generation, its pause and continue, health; the same through the key on
    the server's own port."""
    with httpx.Client(base_url=TRAINER, timeout=120) as trainer:
        generated = trainer.post("/v1/completions", json=PROBE)
        assert generated.status_code == 200, generated.text
        assert trainer.post("/areal_pause_generation", json={}).json()["success"] is True
        assert trainer.post("/areal_continue_generation").json()["success"] is True
        assert trainer.get("/health").status_code == 200
        keyed = httpx.post(f"{access_server.url}/v1/completions", json=PROBE, headers=AUTH, timeout=120)
        assert keyed.json()["choices"][0]["token_ids"] == generated.json()["choices"][0]["token_ids"]
        status = httpx.get(f"{access_server.url}/admin/status", headers=AUTH, timeout=60).json()
        assert status["areal"]["paused"] is False


def test_a_load_from_outside_the_weights_root_is_403_naming_the_setting_and_nothing_of_the_path(
        access_server: ServerProcess, layout: Layout) -> None:
    """Through /admin/update_weights (with the key) and AReaL's route (the trainer's port): the same refusal
    whether the path exists, holds weights or is a system directory, through ``..`` and links; no tensor names, no
    existence; the served weights kept."""
    before = _version(access_server.url)
    secrets = [*_tensor_names(layout.outside), str(layout.outside), "does not exist", "not a directory"]
    for what, path in layout.ways_out.items():
        admin = httpx.post(f"{access_server.url}/admin/update_weights", headers=AUTH, timeout=120,
                           json={"path": path, "version": "outside"})
        areal = httpx.post(f"{TRAINER}/areal_update_weights", json={"model_path": path}, timeout=120)
        for reply, field in ((admin, "path"), (areal, "model_path")):
            assert reply.status_code == 403, (what, reply.text)
            error = reply.json()["error"]
            assert error["param"] == field and error["type"] == "PermissionDeniedError", (what, error)
            assert error["message"] == f"weights not loaded: {field} is outside --weights-root: this server loads " \
                "weights by path only from inside its weights root (symbolic links and '..' resolved); save them " \
                "there, or push them (/admin/weight_uploads)", (what, error)
    linked = httpx.post(f"{access_server.url}/admin/update_weights", headers=AUTH, timeout=120,
                        json={"path": str(ROOT / "file-out"), "version": "outside"})
    assert linked.status_code == 403, linked.text
    message = linked.json()["error"]["message"]
    assert "model.safetensors is a link to a file outside --weights-root" in message
    for secret in secrets:
        assert secret not in message
    assert _version(access_server.url) == before


def test_a_load_from_inside_the_weights_root_loads_by_either_route(access_server: ServerProcess,
                                                                   layout: Layout) -> None:
    before = httpx.post(f"{access_server.url}/v1/completions", json=PROBE, headers=AUTH, timeout=120).json()
    areal = httpx.post(f"{TRAINER}/areal_update_weights", json={"model_path": str(layout.other)}, timeout=300)
    assert areal.status_code == 200, areal.text
    assert _version(access_server.url) == "7"  # AReaL's weight_update_v7
    changed = httpx.post(f"{access_server.url}/v1/completions", json=PROBE, headers=AUTH, timeout=120).json()
    assert changed["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    back = httpx.post(f"{access_server.url}/admin/update_weights", headers=AUTH, timeout=300,
                      json={"path": f"{ROOT}/weight_update_v7/../original", "version": before["weight_version"]})
    assert back.status_code == 200, back.text
    again = httpx.post(f"{access_server.url}/v1/completions", json=PROBE, headers=AUTH, timeout=120).json()
    assert again["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_a_peer_that_refuses_this_servers_key_is_a_configuration_error(access_server: ServerProcess,
                                                                       tiny_server: ServerProcess) -> None:
    """`tiny_server` has another key: listed with a configuration error (not merely unreachable), counted by the
    metric and in the status, and logged."""
    listed = httpx.get(f"{access_server.url}/admin/peers", headers=AUTH, timeout=60).json()
    [peer] = listed["peers"]
    assert peer["url"] == peer_url("tiny_server") and peer["reachable"] is False
    assert "refused this server's API key (401)" in peer["configuration_error"]
    assert "same --api-key on every server" in peer["configuration_error"]

    async def counted() -> bool:
        async with httpx.AsyncClient(base_url=access_server.url, timeout=60) as client:
            return _sample((await client.get("/metrics")).text, 'samrollout_weight_peers{state="key_refused"}') == 1

    asyncio.run(until(counted, "the key refusal to be counted", timeout=120))
    status: dict[str, Any] = httpx.get(f"{access_server.url}/admin/status", headers=AUTH, timeout=60).json()
    assert status["weight_peers"]["key_refused"] == 1 and status["weight_peers"]["answering"] == 0
    assert f"weight peer {peer_url('tiny_server')} refused this server's API key" in access_server.log_tail(200_000)


def _sample(metrics: str, name: str) -> float | None:
    """The value of the sample ``name`` (with its labels) in a /metrics text, or None."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None
