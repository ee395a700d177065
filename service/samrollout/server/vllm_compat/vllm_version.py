"""Which vLLM release series the server runs on: the installed vLLM's ``major.minor``, if supported.

The server reuses vLLM's serving layer, whose modules move between releases; each supported
series has its own layout module (`samrollout.server.vllm_compat.vllm_layouts`).  ``VLLM_VERSION``
overrides the installed version, as it does for vllm-ascend (for vLLM dev builds).
"""

from __future__ import annotations

import os
import re

# Series -> what is supported of it (for messages); the first is the `cpu` extra's (`cuda` allows 0.32 and 0.33).
SUPPORTED_SERIES: dict[str, str] = {"0.32": "vLLM 0.32.x", "0.33": "vLLM 0.33.x",
                                     "0.23": "vLLM 0.23.x (vllm-ascend 0.23)"}


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a release whose serving layer the server knows."""


def installed_vllm_version() -> str:
    """``VLLM_VERSION`` when set, else the imported vLLM's ``__version__``."""
    override = os.environ.get("VLLM_VERSION")
    if override:
        return override
    import vllm

    version: str = vllm.__version__
    return version


def serving_series(version: str | None = None) -> str:
    """The supported series (``"0.32"``, ``"0.33"`` or ``"0.23"``) of ``version`` (default: the installed vLLM).

    Raises `UnsupportedVllmError`, naming the supported versions, for any other release.
    """
    version = installed_vllm_version() if version is None else version
    match = re.match(r"v?(\d+)\.(\d+)(?:\D|$)", version)
    series = f"{match[1]}.{match[2]}" if match else None
    if series not in SUPPORTED_SERIES:
        supported = ", ".join(SUPPORTED_SERIES.values())
        raise UnsupportedVllmError(f"samrollout serve supports {supported}; the installed vLLM is {version}"
                                   " (set VLLM_VERSION for a dev build of a supported release)")
    return series
