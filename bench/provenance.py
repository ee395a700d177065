"""What a result file records about how it was made: the commit that ran, the command line, and the
built-in tokenizer the projections default to.  One copy for every bench script that writes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The repository's HEAD, with ``+dirty`` when the tree has uncommitted changes ("unknown" outside git).
    Take it as a run starts: what is edited meanwhile did not run."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def command_line(script: str) -> str:
    """``python bench/<script>`` with this run's arguments, as a result file records it."""
    return " ".join([f"python bench/{script}", *sys.argv[1:]])


def builtin_tokenizer(given: str | None) -> str:
    """``given``, else the built-in model's directory (`samrollout model smollm2`), fetched on first use."""
    if given is not None:
        return given
    from samrollout.models import ensure_smollm2

    return str(ensure_smollm2())
