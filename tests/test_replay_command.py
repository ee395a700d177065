"""`samrollout replay` end to end: trace files in, table, JSON and plot out."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from samrollout.cli import main
from samrollout.replay.drafters import SamRefDrafter
from samrollout.replay.simulate import replay
from samrollout.replay.traces import TraceError, TraceGroup, load_traces


def _write_group_traces(path: Path, groups: int = 3, siblings: int = 8, length: int = 300) -> None:
    """Siblings that share most of their text at different offsets, as GRPO responses to one prompt do."""
    rng = np.random.default_rng(0)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for g in range(groups):
            prompt = rng.integers(0, 200, size=40).tolist()
            base = rng.integers(0, 200, size=length)
            for s in range(siblings):
                response = np.concatenate([rng.integers(0, 200, size=40 * s), base])
                edits = rng.integers(0, len(response), size=length // 50)
                response[edits] = rng.integers(0, 200, size=len(edits))
                handle.write(json.dumps({"prompt_id": f"p{g}", "sample_index": s, "prompt_ids": prompt,
                                         "response_ids": response.tolist()}) + "\n")


def test_replay_prints_a_table_and_writes_json_and_plot(tmp_path, capsys):
    traces = tmp_path / "traces.jsonl.gz"
    _write_group_traces(traces)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["replay", "--traces", str(traces), "--drafters", "sam,sam-group,sam-ref", "--k", "3",
                 "--threshold", "off", "--long-context", "2048", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "MAL" in printed and "sam-group" in printed and "us/step@2K" in printed
    report = json.loads(out_json.read_text())
    (run,) = report["runs"]
    by_name = {d["drafter"]: d for d in run["drafters"]}
    assert set(by_name) == {"sam", "sam-group", "sam-ref"}
    for d in by_name.values():
        assert 1.0 <= d["mean_acceptance_length"] <= 4.0
        assert 0.0 <= d["acceptance_rate"] <= 1.0
        assert len(d["acceptance_rate_by_position"]) == 3
    # Siblings that share text: drafting across the group accepts clearly more (drafting in every
    # round: with the engine's threshold nothing drafts until at most 8 of these 24 rows run).
    assert by_name["sam-group"]["mean_acceptance_length"] > by_name["sam"]["mean_acceptance_length"] + 0.3
    assert {c["context_tokens"] for c in report["long_context"]} == {2048}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_oracle_replay_of_a_periodic_response_accepts_every_draft_once_the_period_is_seen():
    period = np.arange(10, 20, dtype=np.int32)
    group = TraceGroup("g", np.arange(5, dtype=np.int32), [np.tile(period, 30)])
    result = replay(SamRefDrafter(), [group], k=3)
    # After the first period every step accepts all 3 drafts plus the bonus token.
    assert result.mean_acceptance_length > 3.5
    assert result.tokens == 299  # every token but the prefill one comes from a verification step


def test_text_traces_are_tokenized_with_the_given_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the answer is 42", "let me check the sum again", "so the answer is 42 again"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    traces = tmp_path / "text.jsonl"
    traces.write_text("\n".join(json.dumps({"prompt_id": 1, "prompt": "let me check", "response": line})
                                for line in corpus) + "\n")
    groups = load_traces(traces, tokenizer=str(tmp_path / "tok"))
    assert len(groups) == 1 and len(groups[0].responses) == 3
    assert len(groups[0].responses[0]) == 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "not JSON"),
        ('{"prompt_id": 1, "prompt": "a", "response": "b"}\n', "--tokenizer"),
        ('{"prompt_id": 1, "ids": [1]}\n', "needs prompt_ids"),
        ('{"prompt_ids": [1], "response_ids": [-3]}\n', "outside any vocabulary"),
        ("", "no traces"),
    ],
)
def test_bad_trace_files_are_reported_with_file_and_line(tmp_path, content, message):
    traces = tmp_path / "bad.jsonl"
    traces.write_text(content)
    with pytest.raises((TraceError, ValueError), match=message):
        load_traces(traces)


def test_replay_command_exits_2_with_a_message_for_a_missing_file(tmp_path, capsys):
    assert main(["replay", "--traces", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_drafter_name_is_an_error(tmp_path, capsys):
    traces = tmp_path / "t.jsonl.gz"
    _write_group_traces(traces, groups=1, siblings=2, length=20)
    assert main(["replay", "--traces", str(traces), "--drafters", "sam,nonsense", "--long-context", ""]) == 2
    assert "unknown drafter" in capsys.readouterr().err


def test_past_the_threshold_only_drafts_from_long_matches_are_kept_with_confident_match():
    from samrollout.replay.drafters import SamReplayDrafter

    loop = np.tile(np.arange(20, 30, dtype=np.int32), 30)  # 300 tokens of a 10-token loop: long matches
    noise = np.random.default_rng(1).permutation(200)[:150].astype(np.int32)  # no repeats: short matches
    groups = [TraceGroup(f"p{i}", np.array([1, 2, 3], dtype=np.int32), [loop if i % 2 else noise]) for i in range(12)]
    results = {cm: replay(SamReplayDrafter("sam", 256, confident_match=cm), groups, k=3, threshold=1)
               for cm in (0, 8)}
    assert results[0].drafted == 0  # twelve rows always run: the threshold of 1 drafts nothing
    assert results[8].accepted > 0.9 * results[8].drafted > 0  # the loops draft, nearly all accepted


def test_sam_global_drafts_a_response_from_another_prompts_finished_response(tmp_path, capsys):
    """Prompts whose responses end in one shared passage (a common derivation): the global index
    holds it once the first response finishes, and later responses to other prompts draft from it."""
    rng = np.random.default_rng(1)
    passage = rng.integers(0, 200, size=200).tolist()
    traces = tmp_path / "shared.jsonl.gz"
    with gzip.open(traces, "wt", encoding="utf-8") as handle:
        for g in range(6):
            response = rng.integers(0, 200, size=250 * g).tolist() + passage  # 0 finishes first
            handle.write(json.dumps({"prompt_id": f"p{g}", "prompt_ids": rng.integers(0, 200, size=20).tolist(),
                                     "response_ids": response}) + "\n")
    out_json = tmp_path / "r.json"
    assert main(["replay", "--traces", str(traces), "--drafters", "sam-group,sam-global", "--k", "3",
                 "--threshold", "off", "--long-context", "", "--oracle-sources", "", "--json", str(out_json)]) == 0
    (run,) = json.loads(out_json.read_text())["runs"]
    mal = {d["drafter"]: d["mean_acceptance_length"] for d in run["drafters"]}
    assert mal["sam-global"] > mal["sam-group"] + 0.15  # 1000 of 4950 tokens are the passage
    assert "sam-global" in capsys.readouterr().out


def test_sam_global_holds_the_earlier_rollouts_responses_to_every_prompt(tmp_path):
    """--history: a server that served the earlier rollout indexed its responses as they finished, so a
    response that repeats what an earlier response to another prompt wrote drafts it from the global index."""
    rng = np.random.default_rng(2)
    passages = [rng.integers(0, 200, size=150).tolist() for _ in range(4)]
    traces = tmp_path / "epochs.jsonl.gz"
    with gzip.open(traces, "wt", encoding="utf-8") as handle:
        for g in range(4):
            prompt = rng.integers(0, 200, size=20).tolist()
            earlier = rng.integers(0, 200, size=100).tolist() + passages[g]
            now = rng.integers(0, 200, size=100).tolist() + passages[(g + 1) % 4]  # the next prompt's earlier passage
            for response in (earlier, now):
                handle.write(json.dumps({"prompt_id": f"p{g}", "prompt_ids": prompt, "response_ids": response}) + "\n")
    out_json = tmp_path / "r.json"
    assert main(["replay", "--traces", str(traces), "--drafters", "sam-history,sam-global", "--history", "1",
                 "--k", "8", "--threshold", "off", "--long-context", "", "--oracle-sources", "",
                 "--json", str(out_json)]) == 0
    (run,) = json.loads(out_json.read_text())["runs"]
    accepted = {d["drafter"]: d["accepted"] for d in run["drafters"]}
    assert accepted["sam-global"] > accepted["sam-history"] + 400  # most of the 4 x 150 passage tokens
