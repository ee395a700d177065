"""Validation of token-id arrays at the Python boundary.

The core takes C-contiguous int32 arrays; callers pass lists or numpy arrays of
any integer type.  Converting here, with explicit checks, turns wrong dtypes and
shapes into clear exceptions instead of silent wrap-around.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]
_INT32 = np.iinfo(np.int32)


def as_token_array(values: Any, name: str = "tokens") -> Int32Array:
    """Return ``values`` as a 1-D contiguous int32 array, or raise TypeError/ValueError."""
    if type(values) is np.ndarray and values.dtype == np.int32 and values.ndim == 1 and values.flags.c_contiguous:
        return values  # the hot path: already what the core takes
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer token ids, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {array.shape}")
    if array.dtype != np.int32:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > _INT32.max:
            bad = low if low < 0 else high
            raise ValueError(f"{name} holds token id {bad}, outside any vocabulary")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)
