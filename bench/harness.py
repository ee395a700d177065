"""What the benchmarks that run real servers share: starting and stopping the servers, interleaving the arms of
a comparison round by round, the median round, and writing the result JSON.

    from harness import interleaved, launch_servers, serving, write_json

    servers = launch_servers(2, ["--log-level", "warning"], "samrollout-my-bench")
    with serving(servers) as urls:
        for round_, arm in interleaved(["off", "on"], rounds=3):
            ...
    write_json(path, result)

The benchmarks run as scripts (``python bench/NAME.py``), so this directory is on ``sys.path``; `samrollout` is
imported on first use, so a script's ``--help`` stays quick.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from samrollout.testing import ServerProcess

T = TypeVar("T")


def launch_servers(count: int, args: list[str], log_prefix: str, peered: bool = False) -> list[ServerProcess]:
    """``count`` ``samrollout serve ARGS`` started side by side (each start is mostly imports), not yet ready:
    `serving` waits for them.  Server i logs to ``/tmp/<log_prefix>-<i>.log``; ``peered``: each names all the
    others in ``--weight-peers`` (relayed weight pushes)."""
    from samrollout.testing import launch_peered_servers, launch_server

    logs = [Path(f"/tmp/{log_prefix}-{index}.log") for index in range(count)]
    servers = launch_peered_servers(count, args, logs) if peered else [launch_server(args, log) for log in logs]
    print(f"starting {count} servers (logs: /tmp/{log_prefix}-*.log) ...", file=sys.stderr, flush=True)
    return servers


@contextmanager
def serving(servers: list[ServerProcess]) -> Iterator[list[str]]:
    """Wait until every server answers, give their URLs, and stop them all however the block ends (a server
    that never came up included): no engine process outlives the benchmark."""
    try:
        for server in servers:
            server.ready()
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()


def alternate(arms: Sequence[T], round_: int) -> list[T]:
    """The arms in order in even rounds and reversed in odd ones, so that no arm always runs first."""
    return list(arms) if round_ % 2 == 0 else list(reversed(arms))


def in_turn(arms: Sequence[T], round_: int) -> list[T]:
    """The arms in the same order every round."""
    return list(arms)


def rotate(arms: Sequence[T], round_: int) -> list[T]:
    """The arms rotated by ``round_``, so that each arm takes each place in turn."""
    shift = round_ % len(arms)
    return [*arms[shift:], *arms[:shift]]


def interleaved(arms: Sequence[T], rounds: int, start: int = 0,
                order: Callable[[Sequence[T], int], list[T]] = alternate) -> Iterator[tuple[int, T]]:
    """``(round, arm)`` for every arm in rounds ``start`` .. ``rounds - 1``, each round in ``order``: every arm
    runs once a round, so slow drift of the machine hits every arm alike (a negative ``start``: warm-up rounds)."""
    for round_ in range(start, rounds):
        for arm in order(arms, round_):
            yield round_, arm


def median_round(runs: list[dict[str, Any]], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The median round by ``seconds`` (the lower middle one; without the keys in ``drop``), with the range and the
    mean of the rounds' seconds."""
    ordered = sorted(runs, key=lambda run: run["seconds"])
    row = {key: value for key, value in ordered[(len(ordered) - 1) // 2].items() if key not in drop}
    row["seconds_min"], row["seconds_max"] = ordered[0]["seconds"], ordered[-1]["seconds"]
    row["seconds_mean"] = statistics.fmean(run["seconds"] for run in runs)
    return row


def host() -> dict[str, Any]:
    """The machine a result was measured on, as the result files record it: its cores and its processor."""
    return {"cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine()}


def write_json(path: str | Path, data: Any, indent: int = 2) -> None:
    """Write ``data`` to ``path`` as indented JSON ending in a newline, creating its folder if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (a value that occurred: a worst-case latency stays one)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
