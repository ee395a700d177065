"""The weight version an AReaL checkpoint directory stands for, as the server and AReaL's engine both read it.

AReaL sends no version with a disk weight update: its trainer saves version N under a directory
named ``weight_update_vN`` (``WeightUpdateMeta.with_version``).  The server labels the weights it
loads from there ``"N"`` (``/areal_update_weights``), and `samrollout_client.areal`'s engine names
a pushed copy the same, so both spell it alike.  Standard library only (the server imports it).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

AREAL_CHECKPOINT = re.compile(r"weight_update_v(\d+)")
"""The directory name AReaL saves each disk weight update under (its version N)."""
MAX_VERSION_CHARS = 128


def areal_version(model_path: str) -> str:
    """The version a checkpoint directory stands for: ``N`` for AReaL's ``weight_update_vN``, else its name."""
    name = PurePosixPath(str(model_path).rstrip("/")).name or str(model_path)
    match = AREAL_CHECKPOINT.fullmatch(name)
    return match.group(1) if match else name[:MAX_VERSION_CHARS]
