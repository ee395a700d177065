"""Weight updates pushed over HTTP against the shared-disk path, on one server in one run.

    python bench/weight_push.py --repeats 3 --json bench/results/weight-push-cpu.json

Starts `samrollout serve` with the built-in SmolLM2-135M (its bf16 checkpoint, 269 MB) and
loads that checkpoint into it again and again, four ways (``--paths``), each timed from the
client's call until the server reports the new version:

- ``disk``: ``update_weights(path)``: the server reads the directory itself (shared disk);
- ``push_path``: ``push_weights(path)``: the client streams the directory's files over
  loopback HTTP, the server stages them on its disk, checks them and loads them;
- ``push_state_dict``: ``push_weights(state_dict)``: the same from torch tensors in the
  client's memory, serialised shard by shard (``--shard-mb``) on the way;
- ``push_stream``: ``push_weights(iter(state_dict.items()))``: the same tensors as a stream of
  ``(name, tensor)`` pairs, packed into shards as they are read (what the veRL backend sends).

For the pushes the upload (files sent and staged) and the load (commit: checks, pause, load)
are timed apart; MB/s is the checkpoint's bytes over the upload.  One warm-up of each path
first, then ``--repeats`` rounds, the paths in a rotated order each round; the table shows
the median round and the range.  The JSON keeps every round.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from harness import host, interleaved, median_round, rotate, serving, write_json

PATHS = ("disk", "push_path", "push_state_dict", "push_stream")


def measure(client: Any, path: str, model_dir: Path, state: dict[str, Any], version: str,
            shard_bytes: int) -> dict[str, float]:
    """One weight update along ``path``: seconds in all, and for pushes the upload and load apart."""
    start = time.perf_counter()
    if path == "disk":
        client.update_weights(str(model_dir), version)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "upload_s": 0.0, "load_s": seconds, "bytes": 0.0}
    weights: Any = {"push_path": model_dir, "push_state_dict": state}.get(path, iter(state.items()))
    push = client.push_weights(weights, version, shard_bytes=shard_bytes)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "upload_s": push.upload_s, "load_s": push.load_s, "bytes": float(push.bytes),
            "upload_mb_per_s": push.bytes / 1e6 / push.upload_s, "files": float(len(push.files))}


def summary(runs: list[dict[str, float]], checkpoint_bytes: int) -> dict[str, Any]:
    """Median round by total seconds, the range, and MB/s of the checkpoint over the upload and over it all."""
    median = median_round(runs)
    median["end_to_end_mb_per_s"] = checkpoint_bytes / 1e6 / median["seconds"]
    return median


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-mb", type=int, default=1024, help="state dict shard size (tensor MiB per file)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if set(args.paths) - set(PATHS):
        parser.error(f"unknown paths {sorted(set(args.paths) - set(PATHS))}; choose from {', '.join(PATHS)}")
    return args


def checkpoint() -> tuple[Path, list[Path], dict[str, Any]]:
    """The built-in model's directory, its weight files and their tensors (the state dict pushed from memory)."""
    from safetensors.torch import load_file

    from samrollout.models import ensure_smollm2

    model_dir = ensure_smollm2()
    files = sorted(model_dir.glob("*.safetensors"))
    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(str(file)))
    return model_dir, files, state


def run(args: argparse.Namespace, model_dir: Path, state: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Start the server, warm every path up once, then ``--repeats`` rounds, each in a rotated order: each
    path's rounds."""
    from samrollout.testing import start_server
    from samrollout_client import RolloutClient

    shard_bytes = args.shard_mb * 2**20
    log = Path("/tmp/samrollout-weight-push-bench.log")
    print(f"starting the server (log: {log}) ...", file=sys.stderr, flush=True)
    server = start_server(["--served-model-name", "bench", "--max-model-len", "1024",
                           "--gpu-memory-utilization", "0.1", "--log-level", "warning"], log)
    rounds: dict[str, list[dict[str, float]]] = {path: [] for path in args.paths}
    with serving([server]) as (url,), RolloutClient(url, model="bench") as client:
        for counter, path in enumerate(args.paths, 1):  # warm-up: not counted
            measure(client, path, model_dir, state, f"warm-{counter}", shard_bytes)
        for counter, (round_, path) in enumerate(interleaved(args.paths, args.repeats, order=rotate),
                                                 len(args.paths) + 1):
            result = measure(client, path, model_dir, state, f"v{counter}", shard_bytes)
            print(f"round {round_ + 1}/{args.repeats} {path}: {result['seconds']:.2f} s", file=sys.stderr, flush=True)
            rounds[path].append(result)
    return rounds


def print_table(results: dict[str, dict[str, Any]], checkpoint_bytes: int, files: int, repeats: int) -> None:
    """Per path: the median round, its range, the upload and the load apart, and MB/s."""
    print(f"\ncheckpoint: {checkpoint_bytes / 1e6:.1f} MB in {files} file(s); median of {repeats} rounds "
          "(range); MB/s = checkpoint MB / seconds")
    print(f"{'path':<17}{'total s':>9}{'range s':>15}{'upload s':>10}{'load s':>8}{'upload MB/s':>13}"
          f"{'end-to-end MB/s':>17}")
    for path, row in results.items():
        upload = f"{row['upload_mb_per_s']:>13.0f}" if "upload_mb_per_s" in row else f"{'-':>13}"
        print(f"{path:<17}{row['seconds']:>9.2f}{row['seconds_min']:>7.2f}-{row['seconds_max']:<7.2f}"
              f"{row['upload_s']:>10.2f}{row['load_s']:>8.2f}{upload}{row['end_to_end_mb_per_s']:>17.0f}")


def main() -> None:
    """Start the server, run the paths, print the table, write the JSON."""
    args = parse_args()
    model_dir, files, state = checkpoint()
    checkpoint_bytes = sum(f.stat().st_size for f in files)
    rounds = run(args, model_dir, state)
    results = {path: summary(runs, checkpoint_bytes) for path, runs in rounds.items()}
    print_table(results, checkpoint_bytes, len(files), args.repeats)
    if args.json_path:
        write_json(args.json_path, {
            "model": "SmolLM2-135M-Instruct (built-in, bf16)", "checkpoint_bytes": checkpoint_bytes,
            "checkpoint_files": len(files), "shard_bytes": args.shard_mb * 2**20, "repeats": args.repeats,
            "paths": args.paths, "results": results, "rounds": rounds, **host(),
            "transport": "loopback HTTP, one endpoint"})


if __name__ == "__main__":
    main()
