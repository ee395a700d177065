"""Where a drafter's mean accepted length falls short of the source oracle's: steps per response position.

Replays one trace file (as `samrollout replay` does, every round, one k) through the named drafters and the
oracle of own and group drafts, and counts, per band of response position (where a step starts), the steps
and tokens.  Every drafter replays the same tokens, so the steps a drafter takes beyond the oracle in a band
are where its gap sits.

    python bench/replay_gap.py --traces $R/skyt1-ckpt-aime24.jsonl.gz --tokenizer "$(samrollout model smollm2)" \\
        --responses clean --k 3 --json bench/results/replay-gap-skyt1-clean-k3.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable
from typing import Any

import numpy as np

from samrollout.drafter import DraftPolicy
from samrollout.replay.oracle import SourceOracle
from samrollout.replay.registry import make_drafter, make_source
from samrollout.replay.simulate import replay
from samrollout.replay.traces import load_traces, response_filters, select, vocab_size

BANDS = (0, 64, 256, 1024, 4096, 16384)


def band_of(position: int) -> int:
    """The band index of a response position (BANDS are the bands' first positions)."""
    return int(np.searchsorted(BANDS, position, side="right") - 1)


def recording(drafter: Any, prompts: dict[int, int], steps: np.ndarray, tokens: np.ndarray) -> None:
    """Wrap ``drafter.step`` so that each row's step is counted in the band where it started."""
    step: Callable[..., Any] = drafter.step
    started: set[int] = set()

    def counted(seq_ids: Any, new_tokens: Any, contexts: Any, k: int) -> Any:
        for seq_id, new, context in zip(seq_ids, new_tokens, contexts, strict=True):
            if seq_id in started:  # the first call carries the prefill's token, not a verification step
                band = band_of(len(context) - len(new) - prompts[seq_id])
                steps[band] += 1
                tokens[band] += len(new)
            started.add(seq_id)
        return step(seq_ids, new_tokens, contexts, k)

    drafter.step = counted


def measure(name: str, groups: list[Any], k: int, vocab: int) -> dict[str, Any]:
    """Replay the groups through one drafter (or "oracle"); steps and tokens per band, and the MAL."""
    policy = DraftPolicy().for_hardware(on_cpu=False)
    drafter: Any = (SourceOracle([(s, make_source(s, vocab, policy)) for s in ("own", "group")])
                    if name == "oracle" else make_drafter(name, vocab, policy))
    prompts: dict[int, int] = {}
    seq = 0
    for group in groups:
        for _ in group.responses:
            prompts[seq] = len(group.prompt)
            seq += 1
    steps = np.zeros(len(BANDS), dtype=np.int64)
    tokens = np.zeros(len(BANDS), dtype=np.int64)
    recording(drafter, prompts, steps, tokens)
    result = replay(drafter, groups, k, 8, None, [[] for _ in groups])
    return {"name": drafter.name, "mal": result.mean_acceptance_length, "steps": steps.tolist(),
            "tokens": tokens.tolist()}


def main() -> None:
    """Parse the flags, replay, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", required=True)
    parser.add_argument("--tokenizer")
    parser.add_argument("--responses", choices=["all", "clean"], default="all")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-groups", type=int)
    parser.add_argument("--drafters", default="sam-group,sam-adaptive,sam-counted")
    parser.add_argument("--json")
    args = parser.parse_args()
    groups = select(load_traces(args.traces, args.tokenizer, args.max_groups), response_filters(args.responses)[0], [])
    vocab = vocab_size(groups)
    rows = [measure(name, groups, args.k, vocab) for name in [*args.drafters.split(","), "oracle"]]
    oracle = rows[-1]
    print(f"{'positions':>14} {'tokens':>9} " + " ".join(f"{r['name'][:20]:>20}" for r in rows)
          + "   (MAL in the band; last: steps beyond the oracle, share of the whole gap)")
    for band, start in enumerate(BANDS):
        end = BANDS[band + 1] if band + 1 < len(BANDS) else None
        label = f"{start}-{end or ''}"
        cells = [f"{r['tokens'][band] / max(1, r['steps'][band]):>20.3f}" for r in rows]
        gaps = [f"{r['steps'][band] - oracle['steps'][band]:+d}/"
                f"{(r['steps'][band] - oracle['steps'][band]) / max(1, sum(r['steps']) - sum(oracle['steps'])):.0%}"
                for r in rows[:-1]]
        print(f"{label:>14} {oracle['tokens'][band]:>9} " + " ".join(cells) + "   " + " ".join(gaps))
    print(f"{'all':>14} {sum(oracle['tokens']):>9} " + " ".join(f"{r['mal']:>20.3f}" for r in rows))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as out:
            json.dump({"command": vars(args), "commit": commit, "bands": list(BANDS), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
