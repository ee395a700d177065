"""examples/grpo_cpu.py, two steps against the shared tiny server: it trains, pushes, and every token's version is
the one served when it was sampled."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess
from support.weight_swap import swapping_weights

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import grpo_cpu
import grpo_rollouts


@pytest.fixture(scope="module")
def restored_servers(tiny_server: ServerProcess, second_tiny_server: ServerProcess,
                     tiny_dir: Path) -> Iterator[list[ServerProcess]]:
    """`tiny_server` and `second_tiny_server` (each other's weight peers), put back on their own weights and
    versions after the module."""
    with swapping_weights(tiny_server, "grpo", tiny_dir, tiny_dir), \
            swapping_weights(second_tiny_server, "grpo", tiny_dir, tiny_dir):
        yield [tiny_server, second_tiny_server]


def run_example(servers: list[ServerProcess], policy: Path, out: Path, mode: str) -> dict[str, Any]:
    """Two GRPO steps of 2 groups x 4 samples on the tiny model."""
    urls = [argument for server in servers for argument in ("--url", server.url)]
    return grpo_cpu.main([*urls, "--model", "tiny", "--policy", str(policy), "--api-key", API_KEY,
                          "--mode", mode, "--steps", "2", "--prompts", "4", "--groups", "2", "--n", "4",
                          "--max-tokens", "12", "--lr", "1e-3", "--out", str(out)])


def read_traces(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_grpo_steps_train_push_and_keep_every_tokens_version(restored_servers: list[ServerProcess],
                                                                  tiny_dir: Path, tmp_path: Path, mode: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny random model never answers right: every reward would be 0 and no gradient flow. A stand-in
    # reward that alternates 1, 0, 1, ... gives every group of 4 siblings two of each, so every step has a
    # gradient (a reward read from the text can tie a whole step's groups; the arithmetic reward has its own tests).
    calls = itertools.count()
    monkeypatch.setattr(grpo_rollouts, "arithmetic_reward", lambda text, answer, **_: float(next(calls) % 2 == 0))
    servers = restored_servers if mode == "sync" else restored_servers[:1]  # sync: two servers, the push relayed
    summary = run_example(servers, tiny_dir, tmp_path, mode)
    steps = summary["steps"]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
    pushes = json.loads((tmp_path / "push-log.json").read_text())
    assert [p["version"] for p in pushes[1:]] == [f"{mode}-step-1", f"{mode}-step-2"]
    assert all(p["weight_change"] > 0 for p in pushes[1:])  # what was pushed is not the initial weights
    assert pushes[2]["weight_change"] != pushes[1]["weight_change"]  # and each step pushed new ones
    assert all(admin_status(server)["weight_version"] == f"{mode}-step-2" for server in servers)  # it advanced
    assert all(len(p["relay_chains"]) == 1 and len(p["relay_chains"][0]) == len(servers) for p in pushes[1:])

    lines = read_traces(tmp_path / "rollouts.jsonl.gz")
    assert len(lines) == 2 * 2 * 4 and summary["wrong_version_tokens"] == 0
    order = [p["version"] for p in pushes]
    for line in lines:
        spans = line["meta"]["weight_version_spans"]
        assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == len(line["response_ids"])
        served_by_then = order[:line["meta"]["step"] + 1]  # versions served before this step's batch came back
        assert all(span["version"] in served_by_then for span in spans)
        if mode == "sync":  # nothing generates across a push: the step's version sampled every token
            assert [span["version"] for span in spans] == [order[line["meta"]["step"]]]
    assert (tmp_path / "grpo.png").stat().st_size > 0
