"""New policy weights as the files `AsyncRolloutClient.push_weights` sends: a directory's, or a state dict's shards.

A directory's ``*.safetensors`` files are hashed, then streamed from disk in 1 MiB chunks.
A state dict (name -> torch tensor or numpy array) is serialised one shard at a time, each
of at most ``shard_bytes`` of tensor data (one larger tensor makes a shard of its own), so
the client holds about twice one shard's bytes at once, never the whole model.  A stream
of ``(name, tensor)`` pairs (an iterator or async iterator: what a trainer yields while it
gathers its sharded parameters, e.g. veRL's) is packed into shards as the pairs arrive.  Nothing here
imports torch, numpy or safetensors at import time: safetensors' torch or numpy writer is
imported when a state dict is serialised, and the state dict's own tensors say which.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

DEFAULT_SHARD_BYTES = 2**30  # tensor bytes per serialised shard of a state dict
CHUNK_BYTES = 2**20          # bytes per chunk streamed to the server
HEADER_BYTES_PER_TENSOR = 256  # a generous estimate of one tensor's entry in a safetensors header

NamedTensors = Iterable[tuple[str, Any]] | AsyncIterable[tuple[str, Any]]  # a stream of (name, tensor)
WeightsSource = str | os.PathLike[str] | Mapping[str, Any] | NamedTensors


@dataclass
class WeightFile:
    """One file to send: its name, size and SHA-256, and its bytes (in memory) or where they are (on disk)."""

    name: str
    size: int
    sha256: str
    path: Path | None = None
    data: bytes | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The file's bytes in chunks of `CHUNK_BYTES` (disk reads off the event loop)."""
        if self.data is not None:
            for start in range(0, len(self.data), CHUNK_BYTES):
                yield self.data[start:start + CHUNK_BYTES]
            return
        assert self.path is not None
        with self.path.open("rb") as handle:
            while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
                yield chunk


class WeightFiles:
    """The files of one push, produced one at a time (`files`), and their total size (`total_bytes`; None for a stream).

    Built from a directory path, a state dict or a stream of ``(name, tensor)`` pairs;
    anything else is a TypeError, an empty directory or state dict a ValueError, both
    raised here, before anything is sent (a stream is checked as it is read).
    """

    def __init__(self, weights: WeightsSource, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be at least 1, got {shard_bytes}")
        self._paths: list[Path] = []
        self._state: Mapping[str, Any] | None = None
        self._shards: list[list[str]] = []
        self._stream: NamedTensors | None = None
        self._shard_bytes = shard_bytes
        self.total_bytes: int | None
        if isinstance(weights, str | os.PathLike):
            folder = Path(weights)
            if not folder.is_dir():
                raise ValueError(f"{str(folder)!r} is not a directory: give the directory holding the *.safetensors "
                                 "files, or a state dict")
            self._paths = sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors") and p.is_file())
            if not self._paths:
                raise ValueError(f"{str(folder)!r} holds no *.safetensors files")
            self.total_bytes = sum(p.stat().st_size for p in self._paths)
        elif isinstance(weights, Mapping):
            if not weights:
                raise ValueError("the state dict is empty")
            for name, value in weights.items():
                if not isinstance(name, str):
                    raise TypeError(f"state dict keys must be tensor names (str), got {name!r}")
                _framework(name, value)
            self._state = weights
            self._shards = plan_shards({name: _nbytes(value) for name, value in weights.items()}, shard_bytes)
            header = 8 * len(self._shards) + HEADER_BYTES_PER_TENSOR * len(weights)
            self.total_bytes = sum(_nbytes(value) for value in weights.values()) + header  # an upper estimate
        elif isinstance(weights, AsyncIterable | Iterable) and not isinstance(weights, bytes | bytearray):
            self._stream = cast(NamedTensors, weights)
            self.total_bytes = None
        else:
            raise TypeError("weights must be a directory path of *.safetensors files, a state dict (name -> torch "
                            "tensor or numpy array) or a stream of (name, tensor) pairs, got "
                            f"{type(weights).__name__}")

    @property
    def count(self) -> int | None:
        """How many files the push sends (None for a stream: known once it ends)."""
        return None if self._stream is not None else len(self._paths) or len(self._shards)

    async def files(self) -> AsyncIterator[WeightFile]:
        """Each file in turn: a directory's files hashed, or the state dict's next shard serialised (off the loop)."""
        for path in self._paths:
            digest = await asyncio.to_thread(_file_sha256, path)
            yield WeightFile(path.name, path.stat().st_size, digest, path=path)
        if self._stream is not None:
            async for file in self._stream_files(self._stream):
                yield file
        if self._state is None:
            return
        for index, names in enumerate(self._shards, start=1):
            name = f"model-{index:05d}-of-{len(self._shards):05d}.safetensors"
            data = await asyncio.to_thread(serialize, {n: self._state[n] for n in names})
            yield WeightFile(name, len(data), hashlib.sha256(data).hexdigest(), data=data)


    async def _stream_files(self, stream: NamedTensors) -> AsyncIterator[WeightFile]:
        """The stream's pairs, packed into shards of at most ``shard_bytes`` as they arrive (empty: ValueError)."""
        shard: dict[str, Any] = {}
        filled, index = 0, 0
        async for name, value in _pairs(stream):
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {name!r}")
            _framework(name, value)
            size = _nbytes(value)
            if shard and filled + size > self._shard_bytes:
                index += 1
                yield await _shard_file(f"model-{index:05d}.safetensors", shard)
                shard, filled = {}, 0
            shard[name] = value
            filled += size
        if not shard and index == 0:
            raise ValueError("the stream of (name, tensor) pairs is empty")
        if shard:
            yield await _shard_file(f"model-{index + 1:05d}.safetensors", shard)


async def _pairs(stream: NamedTensors) -> AsyncIterator[tuple[str, Any]]:
    """An iterator's or async iterator's pairs, one at a time."""
    if isinstance(stream, AsyncIterable):
        async for pair in stream:
            yield pair
    else:
        for pair in stream:
            yield pair


async def _shard_file(name: str, tensors: Mapping[str, Any]) -> WeightFile:
    data = await asyncio.to_thread(serialize, tensors)
    return WeightFile(name, len(data), hashlib.sha256(data).hexdigest(), data=data)


def plan_shards(sizes: Mapping[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most ``shard_bytes`` each (a larger tensor alone)."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in sizes.items():
        if current and filled + size > shard_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current:
        shards.append(current)
    return shards


def serialize(tensors: Mapping[str, Any]) -> bytes:
    """One safetensors file's bytes: safetensors' torch writer if any tensor is torch's, else its numpy writer.

    Tensors on an accelerator are copied to host memory; non-contiguous ones are made contiguous.
    """
    frameworks = {_framework(name, value) for name, value in tensors.items()}
    if "torch" in frameworks:
        import torch
        from safetensors.torch import save as save_torch

        host: dict[str, Any] = {}
        storages: set[int] = set()
        for name, value in tensors.items():
            tensor = (torch.from_numpy(value) if _framework(name, value) == "numpy" else value).detach()
            tensor = tensor.to("cpu").contiguous()
            pointer = tensor.untyped_storage().data_ptr()
            host[name] = tensor.clone() if pointer in storages else tensor  # tied weights: one copy each
            storages.add(pointer)
        return save_torch(host, metadata={"format": "pt"})
    import numpy
    from safetensors.numpy import save as save_numpy

    return save_numpy({name: numpy.ascontiguousarray(value) for name, value in tensors.items()},
                      metadata={"format": "np"})


def _framework(name: str, value: Any) -> str:
    """"torch" or "numpy", from the value's type (neither library is imported to tell); TypeError otherwise."""
    module = type(value).__module__.split(".", 1)[0]
    if module in ("torch", "numpy") and hasattr(value, "shape") and hasattr(value, "dtype"):
        return module
    raise TypeError(f"tensor {name!r} is a {type(value).__module__}.{type(value).__name__}: a state dict holds torch "
                    "tensors or numpy arrays")


def _nbytes(value: Any) -> int:
    """Bytes of one tensor's data (torch and numpy both say ``nbytes``; else shape times item size)."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return int(math.prod(value.shape)) * int(value.element_size())


def _file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
