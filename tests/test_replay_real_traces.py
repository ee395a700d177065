"""`samrollout replay` on traces as users have them: several files, meta filters, engine defaults, the oracle."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from samrollout.cli import main
from samrollout.config import SpeculationConfig
from samrollout.drafter import DraftPolicy
from samrollout.replay.drafters import SamReplayDrafter
from samrollout.replay.oracle import SourceOracle
from samrollout.replay.registry import make_source
from samrollout.replay.simulate import replay
from samrollout.replay.traces import TraceGroup, is_clean, load_traces, select

REAL_TRACES = Path(os.environ.get("SAMROLLOUT_REAL_TRACES",
                                  Path(__file__).resolve().parents[1].parent / "shared/data/reasoning-traces"))
ENGINE = SpeculationConfig()


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def _sibling_records(groups: int = 2, siblings: int = 4, length: int = 240, seed: int = 0,
                     meta: Any = None) -> list[dict[str, Any]]:
    """Siblings sharing most of their text at different offsets, with an own repeated phrase each."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 300, size=30).tolist()
        base = rng.integers(0, 300, size=length)
        for s in range(siblings):
            phrase = rng.integers(0, 300, size=12)
            response = np.concatenate([rng.integers(0, 300, size=25 * s), base, np.tile(phrase, 3)])
            edits = rng.integers(0, len(response), size=length // 40)
            response[edits] = rng.integers(0, 300, size=len(edits))
            record: dict[str, Any] = {"prompt_id": f"p{seed}-{g}", "prompt_ids": prompt,
                                      "response_ids": response.tolist()}
            if meta is not None:
                record["meta"] = meta(g, s)
            out.append(record)
    return out


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "out.json"
    assert main(["replay", *argv, "--long-context", "", "--json", str(out)]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def _by_name(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["drafter"]: d for d in run["drafters"]}


def test_several_trace_files_replay_in_one_run_with_results_per_file(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl.gz", _sibling_records(seed=1))
    b = _write(tmp_path / "b.jsonl.gz", _sibling_records(groups=3, seed=2))
    c = _write(tmp_path / "c.jsonl.gz", _sibling_records(groups=1, seed=3))
    report = _run(tmp_path, "--traces", f"{a},{b}", "--traces", str(c), "--drafters", "sam,sam-group")
    assert [run["traces"] for run in report["runs"]] == [str(a), str(b), str(c)]
    assert [run["groups"] for run in report["runs"]] == [2, 3, 1]
    for run in report["runs"]:
        assert set(_by_name(run)) == {"sam", "sam-group"}
    printed = capsys.readouterr().out
    assert all(f"== {path}, responses: all" in printed for path in (a, b, c))


def _meta(g: int, s: int) -> dict[str, Any]:
    """Sibling 0 loops to the limit, sibling 1 stopped unfinished, sibling 2 has no meta fields, 3 is clean."""
    return [{"finished": False, "tail_loop": True}, {"finished": False, "tail_loop": False},
            {"correct": True}, {"finished": True, "tail_loop": False}][s]


def test_clean_responses_are_the_finished_ones_that_do_not_loop_and_records_without_meta_count_as_clean(tmp_path):
    path = _write(tmp_path / "t.jsonl.gz", _sibling_records(meta=_meta))
    groups = load_traces(path)
    clean = select(groups, "clean")
    assert [len(g.responses) for g in clean] == [2, 2]
    assert [len(g.responses) for g in select(groups, "all")] == [4, 4]
    assert is_clean({}) and not is_clean({"finished": False}) and not is_clean({"tail_loop": True})
    report = _run(tmp_path, "--traces", str(path), "--responses", "clean", "--drafters", "sam")
    (run,) = report["runs"]
    assert (run["responses"], run["responses_count"]) == ("clean", 4)


def test_responses_both_gives_a_clean_and_an_all_table(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl.gz", _sibling_records(meta=_meta))
    report = _run(tmp_path, "--traces", str(path), "--responses", "both", "--drafters", "sam,sam-group")
    assert [(r["responses"], r["responses_count"]) for r in report["runs"]] == [("clean", 4), ("all", 8)]
    printed = capsys.readouterr().out
    assert "responses: clean" in printed and "responses: all" in printed
    assert printed.count("MAL tail<=") == 2


def test_where_filters_on_any_meta_field(tmp_path):
    path = _write(tmp_path / "t.jsonl.gz", _sibling_records(meta=_meta))
    report = _run(tmp_path, "--traces", str(path), "--where", "correct=true", "--drafters", "sam")
    assert report["runs"][0]["responses_count"] == 2


def test_groups_left_with_one_response_still_replay_and_the_report_says_so(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl.gz", _sibling_records(meta=lambda g, s: {"finished": s == 0 or g == 1}))
    report = _run(tmp_path, "--traces", str(path), "--responses", "clean", "--drafters", "sam,sam-group")
    (run,) = report["runs"]
    assert (run["groups"], run["responses_count"], run["single_response_groups"]) == (2, 5, 1)
    assert all(d["steps"] > 0 for d in run["drafters"])
    assert "1 group(s) have a single response" in capsys.readouterr().out


def _groups(path: Path) -> list[TraceGroup]:
    return load_traces(path)


def test_the_oracle_accepts_at_every_step_at_least_what_sam_and_sam_group_would(tmp_path):
    groups = _groups(_write(tmp_path / "t.jsonl.gz", _sibling_records(groups=3, siblings=6)))
    policy = DraftPolicy().for_hardware(on_cpu=False)
    vocab = 300
    # sam and sam-group ride along as extra sources: if either ever gave a longer accepted draft than
    # both of the oracle's own sources at the same position, it would be the sole best at that step.
    sources = [(name, make_source(name, vocab, policy)) for name in ("own", "group", "sam", "sam-group")]
    checked = replay(SourceOracle(sources), groups, k=3, tail_rows=8, threshold=None)
    assert checked.source_only_best[2:] == [0, 0]
    assert checked.source_best[0] > 0 and checked.source_best[1] > 0
    # In total too: the oracle's MAL is at least each drafter's on its own trajectory.
    oracle = replay(SourceOracle([(n, make_source(n, vocab, policy)) for n in ("own", "group")]), groups, 3)
    assert oracle.mean_acceptance_length == pytest.approx(checked.mean_acceptance_length)
    for drafter in (SamReplayDrafter("sam", vocab, policy), SamReplayDrafter("sam-group", vocab, policy, group=True)):
        mine = replay(drafter, groups, 3)
        assert oracle.mean_acceptance_length >= mine.mean_acceptance_length


def test_the_oracle_is_labelled_as_an_oracle_and_cannot_be_picked_as_a_drafter(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl.gz", _sibling_records())
    report = _run(tmp_path, "--traces", str(path), "--drafters", "sam,sam-group")
    (run,) = report["runs"]
    assert "oracle(own+group)" not in _by_name(run)
    (oracle,) = run["oracle"]
    assert oracle["oracle"] is True and oracle["drafter"] == "oracle(own+group)"
    assert set(oracle["sources"]) == {"own", "group"} and "not a drafter" in oracle["note"]
    assert oracle["mean_acceptance_length"] >= max(d["mean_acceptance_length"] for d in run["drafters"])
    printed = capsys.readouterr().out
    assert "oracle(own+group)*" in printed and "* oracle, not a drafter" in printed
    assert main(["replay", "--traces", str(path), "--drafters", "sam,oracle", "--long-context", ""]) == 2
    assert "not a drafter" in capsys.readouterr().err
    # Several oracle rows, each over its own sources (a drafter's name is a source too).
    report = _run(tmp_path, "--traces", str(path), "--drafters", "sam", "--oracle-sources", "own,group",
                  "--oracle-sources", "own,sam-ref")
    assert [o["drafter"] for o in report["runs"][0]["oracle"]] == ["oracle(own+group)", "oracle(own+sam-ref)"]
    assert _run(tmp_path, "--traces", str(path), "--drafters", "sam", "--oracle-sources", "")["runs"][0]["oracle"] == []


def test_without_k_our_drafters_use_the_engine_default_k_and_draft_only_at_or_below_its_threshold(tmp_path):
    # More equal-length responses than the threshold: they all run until the last round, so an
    # engine with the static threshold never drafts for them; vLLM's ngram (no threshold) does.
    rows = ENGINE.threshold + 2
    period = list(range(100, 120))
    records = [{"prompt_id": "p", "prompt_ids": [1, 2, 3], "response_ids": period * 30} for _ in range(rows)]
    path = _write(tmp_path / "t.jsonl.gz", records)
    report = _run(tmp_path, "--traces", str(path), "--drafters", "sam,sam-group,ngram", "--confident-match", "0")
    assert report["meta"]["k"] == {"sam": ENGINE.k, "sam-group": ENGINE.k, "ngram": ENGINE.k, "oracle": ENGINE.k}
    mine = _by_name(report["runs"][0])
    assert mine["sam"]["k"] == ENGINE.k and mine["sam"]["drafts_at_most_running"] == ENGINE.threshold
    assert mine["sam"]["drafted"] == 0 and mine["sam"]["mean_acceptance_length"] == 1.0
    assert report["runs"][0]["oracle"][0]["drafted"] == 0
    assert mine["ngram"]["drafts_at_most_running"] is None and mine["ngram"]["mean_acceptance_length"] > 3.0
    # With confident drafts, as the engine's confident_match does, past the threshold rows with a long match
    # (this loop) draft anyway.
    mine = _by_name(_run(tmp_path, "--traces", str(path), "--drafters", "sam", "--confident-match", "8")["runs"][0])
    assert mine["sam"]["mean_acceptance_length"] > 3.0
    # Without the gate (or with fewer rows) ours draft too; --k forces one k on every drafter.
    report = _run(tmp_path, "--traces", str(path), "--drafters", "sam,ngram", "--threshold", "off", "--k", "5")
    mine = _by_name(report["runs"][0])
    assert {d["k"] for d in mine.values()} == {5} and report["runs"][0]["oracle"][0]["k"] == 5
    assert mine["sam"]["drafts_at_most_running"] is None and mine["sam"]["mean_acceptance_length"] > 4.0


def test_suffix_peers_default_to_vllms_k_unless_k_is_given(tmp_path):
    from samrollout.replay.peers import SUFFIX_MAX_TREE_DEPTH, suffix_unavailable_reason

    if suffix_unavailable_reason() is not None:
        pytest.skip(str(suffix_unavailable_reason()))
    path = _write(tmp_path / "t.jsonl.gz", _sibling_records(groups=1, siblings=2))
    report = _run(tmp_path, "--traces", str(path), "--drafters", "sam,suffix-cache")
    assert report["meta"]["k"]["suffix-cache"] == SUFFIX_MAX_TREE_DEPTH == 24
    assert report["meta"]["drafts_at_most_running"]["suffix-cache"] is None
    report = _run(tmp_path, "--traces", str(path), "--drafters", "suffix-cache", "--k", "3")
    assert _by_name(report["runs"][0])["suffix-cache"]["k"] == 3


@pytest.mark.skipif(not (REAL_TRACES / "r1distill-math-samples.jsonl.gz").exists(),
                    reason="the shared reasoning traces are not on this machine")
def test_a_real_text_trace_file_replays_with_the_built_in_tokenizer(tmp_path, smollm2_dir):
    path = REAL_TRACES / "r1distill-math-samples.jsonl.gz"
    report = _run(tmp_path, "--traces", str(path), "--tokenizer", str(smollm2_dir), "--max-groups", "1",
                  "--responses", "both", "--drafters", "sam,sam-group")
    clean, everything = report["runs"]
    assert clean["responses_count"] == everything["responses_count"] == 4  # no response there loops
    assert "--max-groups 1" in clean["note"]
    for run in report["runs"]:
        assert all(d["mean_acceptance_length"] > 1.0 for d in run["drafters"])
