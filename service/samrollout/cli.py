"""Command line: ``samrollout <command>`` (``serve``, ``model``, ``replay``, ``simulate``, ``simulate-rl``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from samrollout.model_command import add_model_parser
from samrollout.replay.command import add_replay_parser
from samrollout.server.command import add_serve_parser
from samrollout.sim.command import add_simulate_parser
from samrollout.sim.rl_command import add_simulate_rl_parser


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(prog="samrollout", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_model_parser(commands)
    add_replay_parser(commands)
    add_simulate_parser(commands)
    add_simulate_rl_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``samrollout`` script."""
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
