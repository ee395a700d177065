"""One draft path: what the engine's proposer drafted is what the replay's session drafts from the same steps.

The proposer inside a real vLLM engine logs every step it saw (rows, new tokens, ids in the batch, the
clock) and the drafts it returned (``SAMROLLOUT_DRAFT_LOG``); a fresh `DraftSession`, the object the
replay and the rollout simulator drive, fed the same steps must return the same drafts, step for step:
across the threshold (confident drafts past it), groups, the cross-epoch history and preemptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import EngineRun, planned_runs
from samrollout.spec_decode.draft_log import DRAFT_LOG_ENV, read_draft_log, replay_draft_log
from samrollout.spec_decode.session import DraftSession
from samrollout.spec_decode.stats import ProposerStats

# The engine's defaults (static threshold 8, confident drafts past it, groups, history), drafting the most.
SAM_DEFAULTS = {"k": 3, "policy": {"min_match_length": 1}}
PROMPTS = ["the cat sat on the mat and the cat sat on the", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
           "x = x + 1\nx = x + 1\nx = x + 1\n", "Once upon a time, in a quiet village by the sea,"]
JOBS: list[dict[str, Any]] = [
    # 24 greedy siblings in 4 groups: the batch starts past the threshold and ends in the tail.
    {"name": "groups", "prompts": [p for p in PROMPTS for _ in range(6)],
     "params": {"temperature": 0, "max_tokens": 96, "ignore_eos": True, "extra_args": {"samrollout_group": "g"}}},
    # The same prompts again: their earlier responses join the new groups (cross-epoch history).
    {"name": "again", "prompts": PROMPTS, "params": {"temperature": 0, "max_tokens": 64, "ignore_eos": True}},
    # n > 1 sampled children (drafted too: `sampled_requests="auto"`).
    {"name": "children", "prompts": PROMPTS[:2], "params": {"temperature": 1.0, "max_tokens": 24, "n": 3,
                                                          "seed": 1}},
]
# 24 blocks x 32 tokens for sequences of up to ~110 tokens: vLLM preempts and resumes some of them.
ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 24, "block_size": 32, "max_num_seqs": 32}


def engine_plan(tiny_dir: Path, smollm2_dir: Path, base: Path) -> dict[str, EngineRun]:
    """The engine whose proposer logs its steps, run in the exactness modules' pool (`planned_engine_runs`)."""
    return {"logged": EngineRun(tiny_dir, SAM_DEFAULTS, JOBS, base / "engine", ENGINE,
                                env={DRAFT_LOG_ENV: str(base / "engine" / "steps.jsonl")}, expected_s=20.0)}


@pytest.fixture(scope="module")
def draft_log(planned_engine_runs: dict[str, Any]) -> Path:
    out = planned_runs(planned_engine_runs, __name__)["logged"]
    assert ProposerStats.from_json(out["proposer"]).draft_tokens > 0
    logs = sorted(Path(out["workdir"]).glob("steps.jsonl.*"))
    assert len(logs) == 1, f"one worker, one log: {logs}"
    return logs[0]


def test_replaying_the_engines_steps_through_a_session_gives_the_engines_drafts(draft_log: Path) -> None:
    pairs = replay_draft_log(draft_log)
    assert pairs, "the proposer logged no step"
    for step, (engine, session) in enumerate(pairs):
        assert session == engine, f"step {step}: the session drafted differently from the engine's proposer"
    drafted = [step for step, (engine, _) in enumerate(pairs) if any(engine)]
    assert len(drafted) > 10


def test_the_logged_steps_cover_the_threshold_confident_drafts_and_preemption(draft_log: Path) -> None:
    session, steps = read_draft_log(draft_log)
    threshold = session.config.threshold
    seen: set[Any] = set()
    previous: set[Any] = set()
    big_batch_drafts = tail_drafts = resumed = 0
    for step in steps:
        running = sum(1 for row in step.rows if row.sampled)
        drafted = sum(1 for draft in step.drafts if draft)
        if running > threshold:
            big_batch_drafts += drafted  # only confident drafts (a match of confident_match+ tokens)
        else:
            tail_drafts += drafted
        for row in step.rows:  # a request seen before that was not in the last batch: preempted, now resumed
            resumed += row.request_id in seen and row.request_id not in previous
            seen.add(row.request_id)
        previous = set(step.present)
    assert big_batch_drafts > 0 and tail_drafts > 0
    assert resumed > 0, "no sequence was preempted and resumed: the KV cache was not small enough"


def test_the_replays_sam_drafters_are_the_engines_session() -> None:
    from samrollout.replay.registry import make_drafter

    for name in ("sam", "sam-group", "sam-history", "sam-global"):
        drafter: Any = make_drafter(name, 256)
        assert isinstance(drafter.session, DraftSession) and drafter.gates_itself
