"""A weight push to several servers: each file to every server (direct) against relayed server to server (fan-out).

    python bench/weight_fanout.py --servers 3 --link-mb-s 0,125 --repeats 3 \\
        --json bench/results/weight-fanout-cpu.json --plot bench/results/weight-fanout-cpu.png
    python bench/weight_fanout.py --scale 1,4 --link-mb-s 125 --repeats 3 \\
        --json bench/results/weight-push-fanout-cpu.json

The second form (``--scale``) asks how a relayed push grows with the servers: it starts the
largest number of servers, each naming all the others as peers, and pushes to the first N of
them for each N given, interleaved (N ascending in even rounds, descending in odd ones), fan-out
on, over one paced link.  Its JSON is ``{"servers": {"1": {"push_s": ...}, "4": {"push_s": ...}},
...}`` (medians of the rounds), with the ratio of the largest to one server, each server's CPU
seconds per push (its API process, engine and workers together: what one hop costs), the
command and the git commit it ran at.

Starts ``--servers`` copies of `samrollout serve` with the built-in SmolLM2-135M (its bf16
checkpoint, 269 MB), each naming all the others in ``--weight-peers``, and pushes that checkpoint
to all of them with `push_weights` again and again, ``fan_out=False`` (the client sends every
file to every server) and ``fan_out=True`` (the client sends each file once; the servers relay
it along a chain), alternating, one warm-up of each first.  Each push is timed from the call
until every server serves the new version; the upload (files sent and staged everywhere) and the
load (commits) apart.

The trainer's link: on one machine every server is a loopback away, so the link costs nothing
and only the servers' work shows (``--link-mb-s 0``).  A positive ``--link-mb-s`` paces what the
client reads from disk to that rate, shared by all its uploads (one network card): 125 MB/s is a
1 Gbit/s link; the servers' links to one another are left at loopback speed (in a cluster each
server has its own card).  The table shows, per link and mode, the median push and the bytes
the client sent; the JSON keeps every round.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from harness import host, interleaved, launch_servers, median_round, serving, write_json
from provenance import git_commit

MODES = {"direct": False, "fan-out": True}


class LinkPacer:
    """One network card of ``mb_per_s`` shared by every upload: each chunk waits for its turn on the wire."""

    def __init__(self, mb_per_s: float) -> None:
        self.bytes_per_s = mb_per_s * 1e6
        self._free_at = 0.0

    async def carry(self, size: int) -> None:
        """Wait until ``size`` more bytes have gone through the link."""
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + size / self.bytes_per_s
        await asyncio.sleep(self._free_at - now)


def pace_uploads(pacer: LinkPacer | None) -> None:
    """Make every file the client sends go through ``pacer`` (None: as fast as loopback goes)."""
    from samrollout_client.weight_sync.weight_files import WeightFile

    original = WeightFile.__dict__.get("_unpaced_chunks") or WeightFile.chunks
    WeightFile._unpaced_chunks = original  # type: ignore[attr-defined]

    async def paced(self: WeightFile) -> AsyncIterator[bytes]:
        async for chunk in original(self):
            if pacer is not None:
                await pacer.carry(len(chunk))
            yield chunk

    WeightFile.chunks = paced  # type: ignore[method-assign]


def push_once(client: Any, model_dir: Path, version: str, fan_out: bool) -> dict[str, Any]:
    """One push of the checkpoint to every server: seconds, upload and load apart, bytes the client sent, chains."""
    push = client.push_weights(str(model_dir), version, fan_out=fan_out)
    return {"seconds": push.seconds, "upload_s": push.upload_s, "load_s": push.load_s, "bytes": push.bytes,
            "bytes_sent": push.bytes_sent, "copies_sent": len(push.relay_chains), "relay_chains": push.relay_chains}


def plot(results: dict[str, dict[str, dict[str, Any]]], servers: int, path: str) -> None:
    """Bars: upload and load seconds per mode, one panel per link."""
    from plotting import save, subplots

    links = list(results)
    fig, axes = subplots(1, len(links), figsize=(4.5 * len(links), 3.6), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        modes = list(results[link])
        uploads = [results[link][m]["upload_s"] for m in modes]
        loads = [results[link][m]["load_s"] for m in modes]
        ax.bar(modes, uploads, label="upload")
        ax.bar(modes, loads, bottom=uploads, label="load (commits)")
        for i, mode in enumerate(modes):
            row = results[link][mode]
            ax.annotate(f"{row['bytes_sent'] / 1e6:.0f} MB sent", (i, row["upload_s"] + row["load_s"]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(f"trainer link: {link}")
        ax.set_ylabel("seconds per push (median)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"SmolLM2-135M checkpoint pushed to {servers} servers")
    save(fig, path)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and all its descendants (0 for one gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def scale(servers: list[Any], sizes: list[int], model_dir: Path, repeats: int, link_mb_s: float) -> dict[str, Any]:
    """Relayed pushes to the first N servers for each N of ``sizes``, interleaved over ``repeats`` rounds after
    one warm-up each: per N, the rounds and their medians (push, upload, load, each server's CPU seconds)."""
    from samrollout_client import RolloutClient

    pace_uploads(LinkPacer(link_mb_s) if link_mb_s else None)
    rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for counter, (round_, n) in enumerate(interleaved(sizes, repeats, start=-1), 1):  # round -1: the warm-up
        targets = servers[:n]
        cpu_before = [tree_cpu_s(server.process.pid) for server in targets]
        with RolloutClient([server.url for server in targets], model="bench") as client:
            run = push_once(client, model_dir, f"scale-{counter}", fan_out=True)
        run["cpu_s"] = [round(tree_cpu_s(server.process.pid) - before, 3)
                        for server, before in zip(targets, cpu_before, strict=True)]
        if round_ >= 0:
            rounds[n].append(run)
            print(f"{n} server(s), round {round_ + 1}/{repeats}: {run['seconds']:.2f} s (CPU s per server "
                  f"{run['cpu_s']})", file=sys.stderr, flush=True)
    result: dict[str, Any] = {}
    for n, runs in rounds.items():
        middle = sorted(runs, key=lambda run: run["seconds"])[(len(runs) - 1) // 2]
        result[str(n)] = {
            "push_s": statistics.median(run["seconds"] for run in runs),
            "upload_s": statistics.median(run["upload_s"] for run in runs),
            "load_s": statistics.median(run["load_s"] for run in runs),
            "cpu_s_per_server": [statistics.median(run["cpu_s"][i] for run in runs) for i in range(n)],
            "bytes_sent": middle["bytes_sent"], "relay_chains": middle["relay_chains"],
            "rounds_s": [run["seconds"] for run in runs]}
    return result


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring); with ``--scale``, ``--servers`` is its largest N."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--scale", type=lambda s: sorted({int(x) for x in s.split(",")}),
                        help="relayed pushes to the first N servers for each N, comma-separated (e.g. 1,4); starts "
                        "the largest N; with one --link-mb-s")
    parser.add_argument("--link-mb-s", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 125.0],
                        help="the trainer's link in MB/s, comma-separated (0: unpaced loopback)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()
    if args.scale:
        if len(args.link_mb_s) != 1:
            parser.error("--scale takes one --link-mb-s")
        args.servers = max(args.scale)
    return args


def compare_modes(urls: list[str], model_dir: Path, links: list[float],
                  repeats: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per link: one warm-up push in each mode, then ``repeats`` rounds of both modes, alternating; every round."""
    from samrollout_client import RolloutClient

    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    counter = itertools.count(1)
    with RolloutClient(urls, model="bench") as client:
        for link in links:
            name = f"{link:g} MB/s" if link else "loopback"
            pace_uploads(LinkPacer(link) if link else None)
            rounds[name] = {mode: [] for mode in MODES}
            for fan_out in MODES.values():  # warm-up: not counted
                push_once(client, model_dir, f"warm-{next(counter)}", fan_out)
            for round_, mode in interleaved(list(MODES), repeats):
                run = push_once(client, model_dir, f"v{next(counter)}", MODES[mode])
                print(f"{name} round {round_ + 1}/{repeats} {mode}: {run['seconds']:.2f} s "
                      f"({run['bytes_sent'] / 1e6:.0f} MB sent)", file=sys.stderr, flush=True)
                rounds[name][mode].append(run)
    return rounds


def print_modes(results: dict[str, dict[str, dict[str, Any]]], checkpoint_bytes: int, servers: int,
                repeats: int) -> None:
    """Per link and mode: the median push, its range, the upload and the load apart, and what the client sent."""
    print(f"\ncheckpoint: {checkpoint_bytes / 1e6:.1f} MB to {servers} servers; median of {repeats} "
          "rounds (range)")
    print(f"{'trainer link':<14}{'mode':<9}{'push s':>8}{'range s':>15}{'upload s':>10}{'load s':>8}"
          f"{'client MB sent':>16}{'copies':>8}")
    for link, by_mode in results.items():
        for mode, row in by_mode.items():
            print(f"{link:<14}{mode:<9}{row['seconds']:>8.2f}{row['seconds_min']:>7.2f}-{row['seconds_max']:<7.2f}"
                  f"{row['upload_s']:>10.2f}{row['load_s']:>8.2f}{row['bytes_sent'] / 1e6:>16.0f}"
                  f"{row['copies_sent']:>8}")
        direct, fanned = by_mode["direct"], by_mode["fan-out"]
        print(f"{'':<14}fan-out: {direct['bytes_sent'] / fanned['bytes_sent']:.1f}x fewer bytes on the link, "
              f"push {direct['seconds'] / fanned['seconds']:.2f}x as fast")


def main() -> None:
    """Start the servers, push in both modes for every link (or, with --scale, to 1..N servers), print the table,
    write the JSON (and the plot)."""
    from samrollout.models import ensure_smollm2

    args = parse_args()
    model_dir = ensure_smollm2()
    checkpoint_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    servers = launch_servers(args.servers, ["--served-model-name", "bench", "--max-model-len", "1024",
                                            "--gpu-memory-utilization", "0.1", "--log-level", "warning"],
                             "samrollout-weight-fanout", peered=True)
    with serving(servers) as urls:
        if args.scale:
            write_scale(args, scale(servers, args.scale, model_dir, args.repeats, args.link_mb_s[0]), checkpoint_bytes)
            return
        rounds = compare_modes(urls, model_dir, args.link_mb_s, args.repeats)
    results = {link: {mode: median_round(runs, drop=("relay_chains",)) for mode, runs in by_mode.items()}
               for link, by_mode in rounds.items()}
    print_modes(results, checkpoint_bytes, args.servers, args.repeats)
    if args.json_path:
        write_json(args.json_path, {
            "model": "SmolLM2-135M-Instruct (built-in, bf16)", "checkpoint_bytes": checkpoint_bytes,
            "servers": args.servers, "repeats": args.repeats, "links_mb_s": args.link_mb_s, "results": results,
            "rounds": rounds, **host(),
            "transport": "loopback HTTP; the trainer's link paced in the client (0: unpaced)"})
    if args.plot_path:
        plot(results, args.servers, args.plot_path)


def write_scale(args: argparse.Namespace, by_size: dict[str, Any], checkpoint_bytes: int) -> None:
    """Print the --scale table and write its JSON: the goal, what bounds it, the command and the commit."""
    one, most = by_size[str(min(args.scale))], by_size[str(max(args.scale))]
    ratio = most["push_s"] / one["push_s"]
    busy = sum(most["cpu_s_per_server"]) / most["push_s"]
    cores = os.cpu_count() or 1
    print(f"\ncheckpoint: {checkpoint_bytes / 1e6:.1f} MB, link {args.link_mb_s[0]:g} MB/s, relayed; median of "
          f"{args.repeats} interleaved rounds")
    for size, row in by_size.items():
        print(f"{size:>3} server(s): push {row['push_s']:.2f} s (upload {row['upload_s']:.2f}, load "
              f"{row['load_s']:.2f}), CPU s per server {row['cpu_s_per_server']}")
    print(f"{max(args.scale)} servers / {min(args.scale)}: {ratio:.2f}x (goal: at most 1.5x); the servers kept "
          f"{busy:.2f} of {cores} cores busy during the {max(args.scale)}-server push")
    result = {"servers": by_size, "ratio": ratio, "goal": "a relayed push to the most servers takes at most 1.5x a "
              "push to one", "servers_cpu_cores_busy": busy, "cpu_count": cores,
              "model": "SmolLM2-135M-Instruct (built-in, bf16)", "checkpoint_bytes": checkpoint_bytes,
              "link_mb_s": args.link_mb_s[0], "repeats": args.repeats,
              "machine": platform.processor() or platform.machine(),
              "transport": "loopback HTTP; the client's link paced to link_mb_s, the servers' to one another not",
              "command": " ".join(["python", *sys.argv]), "git_commit": git_commit()}
    if args.json_path:
        write_json(args.json_path, result)


if __name__ == "__main__":
    main()
