"""The value check of new weights: no NaN or infinity in any floating-point tensor.

A diverged training step writes such a file, and vLLM loads it without a word; every
completion then comes out as token 0.  `first_non_finite` reads each tensor of the (already
structurally checked) safetensors files once, at the offsets their parsed headers give, in
chunks through a memory map, and tests the exponent bits: a float is NaN or infinite exactly
when all its exponent bits are set (for float8 e4m3, which has no infinity, when exponent and
mantissa are all set).  That is one integer AND and compare per value in numpy, with no
conversion to a wider type, so any floating dtype costs the same per byte; integer and
boolean tensors need no check.

It reports what it found and raises nothing of its own: `weights_check` turns a finding into
its `WeightsError`, so this module depends on no other of the server's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> (unsigned view, mask, value): x is NaN or infinite iff (x & mask) == value.
_NON_FINITE: dict[str, tuple[type[np.unsignedinteger], int, int]] = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00, 0x7C00),
    "BF16": (np.uint16, 0x7F80, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),   # e4m3fn: no infinity, NaN is S.1111.111
    "F8_E8M0": (np.uint8, 0xFF, 0xFF),   # the scale format: 0xFF is NaN
    "C64": (np.uint32, 0x7F80_0000, 0x7F80_0000),  # two F32 per value
}
CHUNK_BYTES = 64 * 1024 * 1024  # bounded memory: one chunk's temporaries at a time


@dataclass(frozen=True)
class FileTensors:
    """Where one checked safetensors file keeps its tensors: the data section's offset in the file, and each
    tensor's (name, dtype, begin, end) within it, from the header the layout check parsed (read once)."""

    path: Path
    data_start: int
    tensors: list[tuple[str, str, int, int]]


def _first_non_finite(data: np.memmap, dtype: str, begin: int, end: int) -> int | None:
    """The index of the first NaN or infinite value among the tensor's bytes [begin, end), or None."""
    view, mask, value = _NON_FINITE[dtype]
    width = np.dtype(view).itemsize
    step = max(width, CHUNK_BYTES // width * width)
    for start in range(begin, end, step):
        chunk = np.frombuffer(data[start:min(end, start + step)], dtype=view)
        bad = np.flatnonzero((chunk & view(mask)) == view(value))
        if bad.size:
            return (start - begin) // width + int(bad[0])
    return None


def first_non_finite(files: list[FileTensors]) -> str | None:
    """What is wrong, naming the first tensor (and file) that holds a NaN or infinite value; None when every
    floating-point value is finite.  Each file's data is read once; its header is not read again."""
    for file in files:
        entries = sorted(file.tensors, key=lambda item: item[2])
        if not any(dtype in _NON_FINITE for _, dtype, _, _ in entries):
            continue
        data = np.memmap(file.path, dtype=np.uint8, mode="r")
        try:
            for name, dtype, begin, end in entries:
                if dtype not in _NON_FINITE or begin == end:
                    continue
                index = _first_non_finite(data, dtype, file.data_start + begin, file.data_start + end)
                if index is not None:
                    return (f"{file.path.name}: tensor {name!r} ({dtype}) holds NaN or infinite values "
                            f"(the first at flat index {index})")
        finally:
            del data
    return None
