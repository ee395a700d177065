"""Weights pushed over HTTP (no shared disk): staged on the server, checked, loaded like update_weights, or refused.

Through the real server (`tiny_server`): a state dict pushed by the client changes greedy
outputs and the version, pushing the original weights back restores them, and every bad
push (a damaged or truncated file, other tensor names, shapes or dtypes, a path in the file
name, too many bytes) is a 4xx that leaves the old weights serving.  The staging store
(`samrollout.server.weights.weight_uploads`) on its own, on a real disk with a clock the test moves:
the byte bound while a file streams in, expiry of idle uploads, the bound on open uploads,
leftovers of killed servers.  The client's serialisation: shards of bounded size that hold
every tensor.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_numpy
from safetensors.torch import load as load_torch
from safetensors.torch import load_file, save

from conftest import API_KEY, admin_status
from samrollout.server.errors import ApiError
from samrollout.server.weights.weight_uploads import WeightUploads, default_staging_root, remove_stale_staging
from samrollout.testing import ServerProcess
from samrollout_client import RequestRejected, RolloutClient
from samrollout_client.weight_sync.weight_files import WeightFiles, plan_shards
from support.weight_swap import swapping_weights

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROBE = {"model": "tiny", "prompt": "pushed weights probe", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


# --- helpers ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def version_kept(tiny_server: ServerProcess, tiny_dir: Path) -> Iterator[None]:
    """The shared server leaves this module on the weights and version it came with (modules after it compare
    it with servers at that version)."""
    with swapping_weights(tiny_server, "push", tiny_dir, tiny_dir):
        yield


def _greedy(server: ServerProcess) -> tuple[list[int], str]:
    reply = httpx.post(f"{server.url}/v1/completions", json=PROBE, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["token_ids"], body["weight_version"]




def _open(server: ServerProcess) -> str:
    reply = httpx.post(f"{server.url}/admin/weight_uploads", headers=AUTH, timeout=60)
    assert reply.status_code == 201, reply.text
    upload_id: str = reply.json()["upload_id"]
    return upload_id


def _put(server: ServerProcess, upload_id: str, name: str, data: bytes, sha256: str | None = None) -> httpx.Response:
    digest = sha256 or hashlib.sha256(data).hexdigest()
    return httpx.put(f"{server.url}/admin/weight_uploads/{upload_id}/files/{name}", content=data, timeout=120,
                     headers={**AUTH, "X-Content-SHA256": digest})


def _commit(server: ServerProcess, upload_id: str, version: str) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/weight_uploads/{upload_id}/commit", headers=AUTH, timeout=300,
                      json={"version": version, "in_flight": "abort"})


def _staged_folder(upload_id: str) -> Path:
    """Where the test server (default --weight-staging-dir) stages this upload."""
    (folder,) = default_staging_root().glob(f"server-*/{upload_id}")
    return folder


def _tiny_tensors(tiny_dir: Path) -> dict[str, torch.Tensor]:
    (weights,) = tiny_dir.glob("*.safetensors")
    return load_file(str(weights))


def _perturbed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {name: (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
            for name, t in tensors.items()}


def _first(tensors: dict[str, torch.Tensor], dims: int) -> str:
    return next(name for name in sorted(tensors) if tensors[name].dim() == dims)


# --- through the server ----------------------------------------------------------------------------------------


def test_pushed_state_dict_changes_outputs_and_pushing_the_original_back_restores_them(
        tiny_server: ServerProcess, tiny_dir: Path) -> None:
    before, _ = _greedy(tiny_server)
    with RolloutClient(tiny_server.url, model="tiny", api_key=API_KEY) as client:
        # Shards of at most 4 MiB of tensors: the 12.6 MB embedding alone, the rest in another file.
        pushed = client.push_weights(_perturbed(_tiny_tensors(tiny_dir)), version="pushed-1", shard_bytes=4 * 2**20)
        assert pushed.version == "pushed-1" and pushed.endpoints == 1 and len(pushed.files) >= 2
        assert pushed.bytes == pushed.bytes_sent > 13_000_000 and pushed.mb_per_s > 0
        changed, version = _greedy(tiny_server)
        assert version == "pushed-1" and changed != before
        assert admin_status(tiny_server)["weight_version"] == "pushed-1"
        # The original checkpoint's directory, streamed from disk: outputs come back exactly.
        restored = client.push_weights(tiny_dir, version="pushed-2", in_flight="abort")
        assert restored.files == ["model.safetensors"]
        assert _greedy(tiny_server) == (before, "pushed-2")
    assert admin_status(tiny_server)["weight_uploads"]["open"] == 0  # committed uploads are gone


def _refused_commit(server: ServerProcess, files: dict[str, bytes]) -> dict[str, Any]:
    """Upload ``files``, commit them; the commit must be a 400, and the upload gone afterwards."""
    upload_id = _open(server)
    for name, data in files.items():
        assert _put(server, upload_id, name, data).status_code == 200
    reply = _commit(server, upload_id, "never")
    assert reply.status_code == 400, reply.text
    assert httpx.get(f"{server.url}/admin/weight_uploads/{upload_id}", headers=AUTH).status_code == 404
    assert not list(default_staging_root().glob(f"server-*/{upload_id}"))  # its files are deleted
    error: dict[str, Any] = reply.json()["error"]
    return error


def test_pushes_of_other_tensor_names_shapes_dtypes_or_a_truncated_file_are_400_and_the_old_weights_keep_serving(
        tiny_server: ServerProcess, tiny_dir: Path) -> None:
    before = _greedy(tiny_server)
    tensors = _tiny_tensors(tiny_dir)
    vector, matrix = _first(tensors, 1), _first(tensors, 2)
    renamed = dict(tensors)
    renamed["model.layers.0.not_a_weight"] = renamed.pop(vector)
    full = save(tensors, metadata={"format": "pt"})
    cases = {
        "a tensor the model does not have": ({"model.safetensors": save(renamed)},
                                             "'model.layers.0.not_a_weight' is not in the served model"),
        "a tensor of another shape": ({"model.safetensors": save({**tensors, matrix: tensors[matrix][:-1].clone()})},
                                      "has shape"),
        "a tensor of another dtype": ({"model.safetensors": save({**tensors, vector: tensors[vector].float()})},
                                      "is F32, the served model's is BF16"),
        "a tensor missing": ({"model.safetensors": save({n: t for n, t in tensors.items() if n != vector})},
                             "is in none of the"),
        "a truncated file (its own checksum)": ({"model.safetensors": full[:-1000]}, "truncated or corrupt"),
        "a file that is not safetensors": ({"model.safetensors": b"\x00" * 4096}, "not a safetensors file"),
    }
    for case, (files, says) in cases.items():
        error = _refused_commit(tiny_server, files)
        assert says in error["message"], (case, error)
        assert _greedy(tiny_server) == before, case  # same outputs, same version: nothing was loaded


def test_a_numpy_state_dict_of_another_dtype_is_refused_through_the_client(
        tiny_server: ServerProcess, tiny_dir: Path) -> None:
    before = _greedy(tiny_server)
    as_float32 = {name: t.float().numpy() for name, t in _tiny_tensors(tiny_dir).items()}
    with RolloutClient(tiny_server.url, model="tiny", api_key=API_KEY) as client, \
            pytest.raises(RequestRejected, match="the served model's is BF16") as refused:
        client.push_weights(as_float32, version="never-numpy")
    assert refused.value.status == 400
    assert _greedy(tiny_server) == before and admin_status(tiny_server)["weight_uploads"]["open"] == 0


def test_a_pushed_state_dict_with_nan_values_is_refused_at_commit_naming_the_tensor(
        tiny_server: ServerProcess, tiny_dir: Path) -> None:
    before = _greedy(tiny_server)
    tensors = _tiny_tensors(tiny_dir)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = float("inf")  # one value of one tensor: what a diverged step can leave
    with RolloutClient(tiny_server.url, model="tiny", api_key=API_KEY) as client, \
            pytest.raises(RequestRejected, match=f"tensor '{name}' .* holds NaN or infinite values") as refused:
        client.push_weights(tensors, version="never-inf")
    assert refused.value.status == 400
    assert _greedy(tiny_server) == before and admin_status(tiny_server)["weight_uploads"]["open"] == 0


def test_a_file_damaged_on_the_way_is_refused_by_its_checksum_and_not_staged(
        tiny_server: ServerProcess, tiny_dir: Path) -> None:
    data = (tiny_dir / "model.safetensors").read_bytes()
    upload_id = _open(tiny_server)
    try:
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF
        reply = _put(tiny_server, upload_id, "model.safetensors", bytes(damaged),
                     sha256=hashlib.sha256(data).hexdigest())
        assert reply.status_code == 400 and "SHA-256" in reply.json()["error"]["message"], reply.text
        missing = httpx.put(f"{tiny_server.url}/admin/weight_uploads/{upload_id}/files/model.safetensors",
                            content=data, headers=AUTH, timeout=60)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "X-Content-SHA256"
        shown = httpx.get(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH).json()
        assert shown["files"] == {} and shown["bytes"] == 0
        assert os.listdir(_staged_folder(upload_id)) == []  # no part file left behind
    finally:
        httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH)


@pytest.mark.parametrize("name", ["..%2F..%2Fescaped.safetensors", "sub/dir.safetensors", ".hidden.safetensors",
                                  "model.bin", "%2Fetc%2Fescaped.safetensors", "a%00b.safetensors"])
def test_a_file_name_with_a_path_or_another_extension_is_400(tiny_server: ServerProcess, name: str) -> None:
    upload_id = _open(tiny_server)
    try:
        folder = _staged_folder(upload_id)
        reply = _put(tiny_server, upload_id, name, b"weights")
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "file_name", reply.text
        assert os.listdir(folder) == []
        assert not list(folder.parent.parent.rglob("escaped.safetensors"))
        assert not Path("/etc/escaped.safetensors").exists()
    finally:
        httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH)


def test_cancel_deletes_the_staged_files_and_forgets_the_upload(tiny_server: ServerProcess, tiny_dir: Path) -> None:
    upload_id = _open(tiny_server)
    assert _put(tiny_server, upload_id, "model.safetensors", (tiny_dir / "model.safetensors").read_bytes()).is_success
    folder = _staged_folder(upload_id)
    assert (folder / "model.safetensors").stat().st_size > 13_000_000
    assert admin_status(tiny_server)["weight_uploads"]["open"] >= 1
    cancelled = httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH)
    assert cancelled.status_code == 200 and cancelled.json() == {"upload_id": upload_id, "cancelled": True}
    assert not folder.exists()
    for reply in (httpx.get(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH),
                  _put(tiny_server, upload_id, "model.safetensors", b"x"), _commit(tiny_server, upload_id, "never"),
                  httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH)):
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "upload_id", reply.text


def test_a_file_announced_larger_than_the_upload_bound_is_413_before_any_byte_is_read(
        tiny_server: ServerProcess) -> None:
    upload_id = _open(tiny_server)
    try:
        bound = httpx.get(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH).json()["max_bytes"]
        # As curl sends a large file: headers with Expect: 100-continue, the body only once the server agrees.
        url = urlsplit(tiny_server.url)
        request = (f"PUT /admin/weight_uploads/{upload_id}/files/model.safetensors HTTP/1.1\r\n"
                   f"Host: {url.netloc}\r\nAuthorization: Bearer {API_KEY}\r\nX-Content-SHA256: {'0' * 64}\r\n"
                   f"Content-Length: {bound + 1}\r\nExpect: 100-continue\r\n\r\n")
        with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
            sock.sendall(request.encode())
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"--max-weight-upload-bytes" in answer
        assert httpx.get(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH).json()["bytes"] == 0
    finally:
        httpx.delete(f"{tiny_server.url}/admin/weight_uploads/{upload_id}", headers=AUTH)


def test_a_push_larger_than_the_server_bound_is_refused_before_sending_and_nothing_stays_staged(
        tiny_server: ServerProcess) -> None:
    before = _greedy(tiny_server)
    bound = admin_status(tiny_server)["weight_uploads"]["max_bytes_per_upload"]
    too_big = {"model.embed_tokens.weight": np.zeros(bound // 2 + 1, dtype=np.uint16)}  # bound + 2 bytes
    with RolloutClient(tiny_server.url, model="tiny", api_key=API_KEY) as client, \
            pytest.raises(RequestRejected, match="exceed the server's upload bound") as refused:
        client.push_weights(too_big, version="never-too-big")
    assert refused.value.status == 413
    assert admin_status(tiny_server)["weight_uploads"]["open"] == 0 and _greedy(tiny_server) == before


def test_weight_upload_routes_need_the_api_key(tiny_server: ServerProcess) -> None:
    assert httpx.post(f"{tiny_server.url}/admin/weight_uploads", timeout=30).status_code == 401
    assert httpx.put(f"{tiny_server.url}/admin/weight_uploads/{'0' * 32}/files/model.safetensors", content=b"x",
                     timeout=30).status_code == 401


# --- the staging store on its own ------------------------------------------------------------------------------


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


def _receive(store: WeightUploads, upload_id: str, name: str, data: bytes,
             declared: int | None = None) -> dict[str, Any]:
    return asyncio.run(store.receive(upload_id, name, _chunks(data), hashlib.sha256(data).hexdigest(), declared))


def test_an_upload_left_idle_expires_and_its_files_are_deleted(tmp_path: Path) -> None:
    clock = _Clock()
    store = WeightUploads(tmp_path, max_bytes=10_000, max_uploads=2, idle_seconds=60, clock=clock)
    idle, active = store.create(), store.create()
    _receive(store, idle.upload_id, "a.safetensors", b"x" * 100)
    clock.now += 50
    _receive(store, active.upload_id, "a.safetensors", b"y" * 100)  # activity keeps an upload alive
    clock.now += 20
    assert store.expire() == [idle.upload_id]
    assert not idle.folder.exists() and (active.folder / "a.safetensors").exists()
    with pytest.raises(ApiError) as gone:
        store.get(idle.upload_id)
    assert gone.value.status == 404 and "expired" in gone.value.message
    assert store.status()["open"] == 1 and store.status()["staged_bytes"] == 100
    store.close()
    assert not store.folder.exists()


def test_a_file_streamed_past_the_upload_bound_is_413_and_leaves_nothing_behind(tmp_path: Path) -> None:
    store = WeightUploads(tmp_path, max_bytes=5_000, max_uploads=1, idle_seconds=60)
    upload = store.create()
    _receive(store, upload.upload_id, "first.safetensors", b"a" * 3_000)
    with pytest.raises(ApiError) as refused:  # no Content-Length: counted as the bytes arrive
        _receive(store, upload.upload_id, "second.safetensors", b"b" * 2_001)
    assert refused.value.status == 413 and "past its bound of 5000 bytes" in refused.value.message
    assert sorted(os.listdir(upload.folder)) == ["first.safetensors"]
    assert store.describe(upload)["bytes"] == 3_000
    with pytest.raises(ApiError) as announced:
        _receive(store, upload.upload_id, "second.safetensors", b"b" * 10, declared=2_001)
    assert announced.value.status == 413
    _receive(store, upload.upload_id, "second.safetensors", b"b" * 2_000)  # exactly up to the bound fits
    assert store.describe(upload)["bytes"] == 5_000
    store.close()


def test_at_most_max_uploads_are_open_at_once(tmp_path: Path) -> None:
    store = WeightUploads(tmp_path, max_bytes=100, max_uploads=2, idle_seconds=60)
    first = store.create()
    store.create()
    with pytest.raises(ApiError) as refused:
        store.create()
    assert refused.value.status == 429 and "--max-weight-uploads 2" in refused.value.message
    store.cancel(first.upload_id)
    store.create()
    store.close()


def test_staging_left_by_a_server_that_no_longer_runs_is_deleted_at_the_next_start(tmp_path: Path) -> None:
    store = WeightUploads(tmp_path, max_bytes=100, max_uploads=1, idle_seconds=60)
    live = store.folder
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    leftover = tmp_path / live.name.replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
    leftover.mkdir()
    (leftover / "big.safetensors").write_bytes(b"z" * 1000)
    unrelated = tmp_path / "something-else"
    unrelated.mkdir()
    assert remove_stale_staging(tmp_path, keep=live) == [leftover]
    assert live.exists() and unrelated.exists() and not leftover.exists()
    store.close()


# --- the client's serialisation ---------------------------------------------------------------------------------


def test_shards_hold_every_tensor_in_order_within_the_shard_bound() -> None:
    assert plan_shards({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]


def test_a_state_dict_is_sent_as_bounded_shards_that_hold_every_tensor_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {f"layer.{i}.weight": torch.randn(64, 64, generator=generator).to(torch.bfloat16)
                             for i in range(6)}
    state["layer.0.weight"] = state["layer.0.weight"].t()  # not contiguous: made so on the way
    source = WeightFiles(state, shard_bytes=3 * 64 * 64 * 2)

    async def collect() -> list[Any]:
        return [file async for file in source.files()]

    files = asyncio.run(collect())
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert source.count == 2 and sum(f.size for f in files) <= source.total_bytes
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        assert file.data is not None and hashlib.sha256(file.data).hexdigest() == file.sha256
        loaded.update(load_torch(file.data))
    assert sorted(load_torch(files[0].data or b"")) == ["layer.0.weight", "layer.1.weight", "layer.2.weight"]
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[n], state[n]) for n in state)
    numpy_files = asyncio.run(_collect(WeightFiles({"x": np.arange(6, dtype=np.float32).reshape(2, 3)})))
    assert numpy_files[0].data is not None
    assert load_numpy(numpy_files[0].data)["x"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_stream_of_named_tensors_is_packed_into_bounded_shards_as_it_is_read() -> None:
    """What a trainer yields while gathering sharded parameters; tied tensors sharing storage are kept apart."""
    generator = torch.Generator().manual_seed(1)
    pairs = [(f"layer.{i}.weight", torch.randn(32, 32, generator=generator)) for i in range(5)]
    pairs.insert(1, ("tied.weight", pairs[0][1]))  # in layer.0.weight's shard, sharing its storage

    async def stream() -> AsyncIterator[tuple[str, Any]]:
        for pair in pairs:
            yield pair

    source = WeightFiles(stream(), shard_bytes=2 * 32 * 32 * 4)
    assert source.count is None and source.total_bytes is None
    files = asyncio.run(_collect(source))
    assert [f.name for f in files] == [f"model-{i:05d}.safetensors" for i in range(1, 4)]
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        loaded.update(load_torch(file.data or b""))
    assert sorted(loaded) == sorted(n for n, _ in pairs) and all(torch.equal(loaded[n], t) for n, t in pairs)
    assert [f.name for f in asyncio.run(_collect(WeightFiles(iter(pairs[:1]))))] == ["model-00001.safetensors"]
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(_collect(WeightFiles(iter([]))))


async def _collect(source: WeightFiles) -> list[Any]:
    return [file async for file in source.files()]


@pytest.mark.parametrize(("weights", "error"), [
    ({"w": [1.0, 2.0]}, "torch tensors or numpy arrays"),
    ({}, "empty"),
    (42, "directory path of"),
    ("/no/such/directory", "is not a directory"),
])
def test_weights_that_cannot_be_pushed_are_refused_before_any_request(weights: Any, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        WeightFiles(weights)
