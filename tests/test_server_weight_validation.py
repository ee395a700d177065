"""Weight updates are checked before the engine sees them: a bad directory is a 400 and the old weights keep serving.

The checker (`samrollout.server.weights.weights_check`) reads safetensors headers only; here it is run
on small files written with safetensors' own writer, and through the real server
(`tiny_server`) on broken copies of a valid update (`tiny_weights_v2`).
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import API_KEY
from samrollout.server.weights.weights_check import WeightsError, check_weights_dir, checkpoint_layout, read_header
from samrollout.testing import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _raw_file(path: Path, header: dict[str, Any], data: bytes) -> Path:
    """A safetensors file written by hand: 8-byte little-endian header length, JSON header, data."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


# --- the checker on small files ------------------------------------------------------------------------------


def test_checker_reads_names_shapes_and_dtypes_of_a_valid_file(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.ones(4)}, str(tmp_path / "w.safetensors"))
    assert read_header(tmp_path / "w.safetensors") == {"a": ((2, 3), "BF16"), "b": ((4,), "F32")}
    layout = checkpoint_layout(str(tmp_path))
    assert layout == {"a": ((2, 3), "BF16"), "b": ((4,), "F32")}
    assert check_weights_dir(str(tmp_path), layout) == tmp_path


BROKEN_FILES: dict[str, tuple[dict[str, Any] | None, bytes, str]] = {
    # name: (header, or None for raw bytes; data or the raw bytes; what the error says)
    "empty file": (None, b"", "too short"),
    "random bytes": (None, random.Random(0).randbytes(256), "not a safetensors file"),
    "header not JSON": (None, struct.pack("<Q", 4) + b"{no}", "not JSON"),
    "data cut short": ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(12), "truncated"),
    "data padded": ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(20), "truncated"),
    "offsets disagree with the shape": (
        {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8), "needs 16 bytes"),
    "overlapping tensors": ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "overlapping"),
    "unknown dtype": ({"t": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16), "unknown dtype"),
    "negative dimension": ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "malformed shape"),
}


@pytest.mark.parametrize("case", BROKEN_FILES)
def test_checker_rejects_a_broken_file_naming_it(tmp_path: Path, case: str) -> None:
    header, data, says = BROKEN_FILES[case]
    file = tmp_path / "model-00001.safetensors"
    if header is None:
        file.write_bytes(data)
    else:
        _raw_file(file, header, data)
    with pytest.raises(WeightsError, match=says) as error:
        check_weights_dir(str(tmp_path), None)
    assert "model-00001.safetensors" in str(error.value)


def test_checker_compares_every_tensor_with_the_served_layout(tmp_path: Path) -> None:
    served = {"a": ((2, 3), "BF16"), "b": ((4,), "F32")}
    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.ones(4)}, str(tmp_path / "w.safetensors"))
    check_weights_dir(str(tmp_path), served)
    with pytest.raises(WeightsError, match=r"w\.safetensors: tensor 'b' has shape \[4\], the served model's is \[5\]"):
        check_weights_dir(str(tmp_path), {**served, "b": ((5,), "F32")})
    with pytest.raises(WeightsError, match=r"w\.safetensors: tensor 'a' is BF16, the served model's is F16"):
        check_weights_dir(str(tmp_path), {**served, "a": ((2, 3), "F16")})
    with pytest.raises(WeightsError, match="tensor 'c' of the served model is in none"):
        check_weights_dir(str(tmp_path), {**served, "c": ((1,), "F32")})
    with pytest.raises(WeightsError, match=r"w\.safetensors: tensor 'b' is not in the served model"):
        check_weights_dir(str(tmp_path), {"a": served["a"]})


def test_checker_rejects_a_tensor_held_by_two_files(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(WeightsError, match=r"tensor 'a' is in both one\.safetensors and two\.safetensors"):
        check_weights_dir(str(tmp_path), None)


@pytest.mark.parametrize(("path", "says"), [
    ("/" + "a" * 99_999, "too long"),
    ("/no/such/directory", "does not exist"),
    ("bad\x00path", "NUL"),
])
def test_checker_turns_path_errors_into_a_message(path: str, says: str) -> None:
    with pytest.raises(WeightsError, match=says) as error:
        check_weights_dir(path, None)
    assert len(str(error.value)) < 400  # a huge path is shortened in the message


def test_checker_rejects_a_file_or_a_directory_without_weights(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(WeightsError, match="is not a directory"):
        check_weights_dir(str(tmp_path / "w.safetensors"), None)
    with pytest.raises(WeightsError, match="not a directory"):
        check_weights_dir(str(tmp_path / "w.safetensors" / "below"), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match=r"holds no \*.safetensors files"):
        check_weights_dir(str(tmp_path / "empty"), None)


FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2, torch.float8_e4m3fn]
NON_FINITE = [(dtype, bad) for dtype in FLOAT_DTYPES for bad in (float("nan"), float("inf"), float("-inf"))
              if dtype != torch.float8_e4m3fn or bad != bad]  # e4m3fn has no infinity (torch saturates it to 448)


@pytest.mark.parametrize(("dtype", "bad"), NON_FINITE, ids=[f"{d}-{b}" for d, b in NON_FINITE])
def test_value_check_finds_a_single_non_finite_value_in_any_float_dtype(tmp_path: Path, dtype: torch.dtype,
                                                                        bad: float) -> None:
    good = {"ints": torch.arange(8, dtype=torch.int64), "w": torch.linspace(-3, 3, 1000).to(dtype)}
    save_file(good, str(tmp_path / "w.safetensors"))
    check_weights_dir(str(tmp_path), None, values=True)  # finite values pass
    poisoned = torch.linspace(-3, 3, 1000)
    poisoned[777] = bad
    save_file({**good, "w": poisoned.to(dtype)}, str(tmp_path / "w.safetensors"))
    check_weights_dir(str(tmp_path), None, values=False)  # the structure is fine: only the value check sees it
    with pytest.raises(WeightsError, match=r"w\.safetensors: tensor 'w' .* holds NaN or infinite values "
                                           r"\(the first at flat index 777\)"):
        check_weights_dir(str(tmp_path), None, values=True)


def test_value_check_reads_tensors_larger_than_one_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from samrollout.server.weights import weight_values

    monkeypatch.setattr(weight_values, "CHUNK_BYTES", 4096)
    values = torch.zeros(10_000, dtype=torch.bfloat16)
    values[9_999] = float("nan")
    save_file({"a": torch.ones(3), "big": values}, str(tmp_path / "w.safetensors"))
    with pytest.raises(WeightsError, match=r"tensor 'big' .* flat index 9999"):
        check_weights_dir(str(tmp_path), None, values=True)


@pytest.mark.parametrize("kind", ["fifo", "socket", "link to a fifo"])
def test_checker_refuses_special_files_without_opening_them(tmp_path: Path, kind: str) -> None:
    import socket

    save_file({"a": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    if kind == "fifo":
        os.mkfifo(tmp_path / "model-00002.safetensors")  # opening it to read would block forever
        says = "model-00002.safetensors is a FIFO"
    elif kind == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "sock"))
        says = "sock is a socket"
    else:
        os.mkfifo(tmp_path / "pipe")
        (tmp_path / "extra.safetensors").symlink_to(tmp_path / "pipe")
        says = "is a FIFO"
    with pytest.raises(WeightsError, match=says):
        check_weights_dir(str(tmp_path), None, values=True)


def test_a_hub_models_layout_is_read_from_its_downloaded_snapshot(tiny_dir: Path, tmp_path: Path) -> None:
    """A model served by hub id is checked like a directory once the engine downloaded it (its snapshot in the
    Hugging Face cache, or vLLM's --download-dir, read by huggingface_hub itself, offline); one never downloaded
    has no layout to check against."""
    repo = tmp_path / "models--samrollout-test--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for file in tiny_dir.glob("*.safetensors"):
        os.link(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    layout = checkpoint_layout("samrollout-test/tiny", download_dir=str(tmp_path))
    assert layout is not None and layout == checkpoint_layout(str(tiny_dir))
    assert checkpoint_layout("samrollout-test/never-downloaded", download_dir=str(tmp_path)) is None
    assert checkpoint_layout("/no/such/directory") is None


def test_tiny_models_other_weights_match_its_served_layout(tiny_dir: Path, tiny_weights_v2: Path) -> None:
    layout = checkpoint_layout(str(tiny_dir))
    assert layout and all(dtype == "BF16" for _, dtype in layout.values())
    assert check_weights_dir(str(tiny_weights_v2), layout) == tiny_weights_v2


# --- through the server ----------------------------------------------------------------------------------------

Edit = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _first(tensors: dict[str, torch.Tensor], dims: int) -> str:
    return next(name for name in sorted(tensors) if tensors[name].dim() == dims)


def _reshaped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = _first(tensors, 2)
    return {**tensors, name: tensors[name][:-1].contiguous()}


def _retyped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = _first(tensors, 1)
    return {**tensors, name: tensors[name].float()}


def _renamed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = _first(tensors, 1)
    out = dict(tensors)
    out["model.layers.0.not_a_weight"] = out.pop(name)
    return out


def _dropped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    out.pop(_first(tensors, 1))
    return out


TENSOR_EDITS: dict[str, tuple[Edit, str]] = {
    "a tensor of another shape": (_reshaped, "has shape"),
    "a tensor of another dtype": (_retyped, "is F32, the served model's is BF16"),
    "a tensor the model does not have": (_renamed, "'model.layers.0.not_a_weight' is not in the served model"),
    "a tensor missing": (_dropped, "is in none of the"),
}


def _weights_copy(source: Path, target: Path) -> Path:
    """The update's weight files (nothing else) under ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.glob("*.safetensors"):
        (target / file.name).write_bytes(file.read_bytes())
    return target


def _bad_updates(tiny_weights_v2: Path, work: Path) -> dict[str, tuple[str, str]]:
    """Case -> (path to send, what the 400's message must say), every one built from the valid update."""
    (weights,) = tiny_weights_v2.glob("*.safetensors")
    cases: dict[str, tuple[str, str]] = {}
    corrupt = _weights_copy(tiny_weights_v2, work / "corrupt")
    (corrupt / weights.name).write_bytes(random.Random(1).randbytes(weights.stat().st_size))
    cases["random bytes in the file"] = (str(corrupt), f"{weights.name} is not a safetensors file")
    truncated = _weights_copy(tiny_weights_v2, work / "truncated")
    with (truncated / weights.name).open("r+b") as handle:
        handle.truncate(weights.stat().st_size - 1000)
    cases["a truncated file"] = (str(truncated), f"{weights.name} is truncated or corrupt")
    tensors = load_file(str(weights))
    for case, (edit, says) in TENSOR_EDITS.items():
        folder = work / case.replace(" ", "-")
        folder.mkdir()
        save_file(edit(dict(tensors)), str(folder / weights.name), metadata={"format": "pt"})
        cases[case] = (str(folder), says)
    nan = {name: torch.full_like(t, float("nan")) if t.is_floating_point() else t for name, t in tensors.items()}
    (work / "nan").mkdir()
    save_file(nan, str(work / "nan" / weights.name), metadata={"format": "pt"})
    cases["every value NaN (a diverged step)"] = (str(work / "nan"), "holds NaN or infinite values")
    infinite = _weights_copy(tiny_weights_v2, work / "inf")
    with (infinite / weights.name).open("r+b") as handle:  # the reproduction: bytes after the header 0xFF
        (length,) = struct.unpack("<Q", handle.read(8))
        handle.seek(8 + length)
        handle.write(b"\xff" * (weights.stat().st_size - 8 - length))
    cases["every byte after the header 0xFF"] = (str(infinite), "holds NaN or infinite values")
    fifo = _weights_copy(tiny_weights_v2, work / "fifo")
    (fifo / weights.name).unlink()
    os.mkfifo(fifo / weights.name)  # reading it would block until someone writes
    cases["a FIFO instead of the weights file"] = (str(fifo), f"{weights.name} is a FIFO")
    cases["a 100,000-character path"] = ("/" + "w" * 99_999, "over the limit of 4096 bytes for a path")
    cases["a file instead of a directory"] = (str(weights), "is not a directory")
    cases["a directory that does not exist"] = (str(work / "absent"), "does not exist")
    return cases


def _status(server: ServerProcess) -> dict[str, Any]:
    reply = httpx.get(f"{server.url}/admin/status", headers=AUTH, timeout=60)
    assert reply.status_code == 200
    result: dict[str, Any] = reply.json()
    return result


def test_bad_weight_updates_are_400_and_the_old_weights_keep_serving(
        tiny_server: ServerProcess, tiny_weights_v2: Path, tmp_path: Path) -> None:
    version = _status(tiny_server)["weight_version"]
    probe = {"model": "tiny", "prompt": "still serving", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = httpx.post(f"{tiny_server.url}/v1/completions", json=probe, headers=AUTH, timeout=60).json()
    for case, (path, says) in _bad_updates(tiny_weights_v2, tmp_path).items():
        reply = httpx.post(f"{tiny_server.url}/admin/update_weights", headers=AUTH, timeout=120,
                           json={"path": path, "version": f"never-{case}", "in_flight": "abort"})
        assert reply.status_code == 400, (case, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "path" and says in error["message"], (case, error)
        assert _status(tiny_server)["weight_version"] == version, case
        after = httpx.post(f"{tiny_server.url}/v1/completions", json=probe, headers=AUTH, timeout=60)
        assert after.status_code == 200, (case, after.text)
        assert after.json()["choices"][0]["token_ids"] == before["choices"][0]["token_ids"], case  # old weights
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
