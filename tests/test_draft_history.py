"""Cross-epoch history: earlier rollouts' responses to a prompt are drafting text for later ones, bounded."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from conftest import API_KEY, EngineRun, admin_status, planned_runs
from samrollout import DraftPolicy, SamDrafter
from samrollout.config import SpeculationConfig
from samrollout.history import ResponseHistory
from samrollout.replay.drafters import SamReplayDrafter
from samrollout.server.settings import ServerSettings
from samrollout.spec_decode.session import DraftSession, SessionSettings, StepRow
from samrollout.spec_decode.stats import HistoryStats, ProposerStats
from samrollout.testing import ServerProcess
from samrollout_client.protocol.prompt_identity import prompt_digest

VOCAB = 1000
PROMPT = [11, 12, 13, 14]


def _no_loop(length: int, seed: int = 0) -> list[int]:
    """A response without repeats: nothing in it predicts its own continuation."""
    return np.random.default_rng(seed).permutation(VOCAB)[:length].tolist()


def test_a_response_of_an_earlier_rollout_drafts_a_later_response_from_its_first_tokens():
    earlier = _no_loop(200)
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    drafter.add_request("later", PROMPT, group="g")
    assert drafter.add_to_group("g", earlier)
    accepted = 0
    for position in range(1, 150):
        draft = drafter.step(["later"], [earlier[position - 1: position]], 3).tokens[0]
        accepted += int(draft == earlier[position: position + 3])
    assert accepted == 149  # every step drafts the earlier response's next three tokens

    alone = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    alone.add_request("later", PROMPT, group="g")
    drafts = [alone.step(["later"], [earlier[p - 1: p]], 3).tokens[0] for p in range(1, 150)]
    assert not any(draft and draft[0] == earlier[p] for p, draft in enumerate(drafts, start=1))


def test_history_joining_a_group_respects_the_group_token_bound():
    drafter = SamDrafter(VOCAB, DraftPolicy(max_group_tokens=300))
    drafter.add_request("live", PROMPT, group="g")
    assert drafter.add_to_group("g", _no_loop(200, seed=1))
    assert not drafter.add_to_group("g", _no_loop(200, seed=2))  # would pass 300: refused, nothing indexed
    drafter.append("live", _no_loop(50, seed=3))
    assert not drafter.info("live")["group_overflow"]  # the live group keeps drafting
    with pytest.raises(KeyError):
        drafter.add_to_group("no such group", [1, 2])


def test_the_drafter_hands_back_the_response_it_indexed():
    drafter = SamDrafter(VOCAB)
    drafter.add_request("r", PROMPT, group="g")
    drafter.step(["r"], [[5, 6]], 3)
    drafter.append("r", [7])
    assert drafter.response("r").tolist() == [5, 6, 7]


def test_history_keeps_the_newest_responses_per_prompt_and_evicts_least_recent_prompts_past_its_tokens():
    history = ResponseHistory(max_tokens=1000, responses_per_prompt=2)
    a, b = prompt_digest([1, 2, 3]), prompt_digest([4, 5])
    for i in range(3):
        history.record(a, f"a{i}", [i] * 100)
    assert [r[0] for r in history.responses(a)] == [1, 2] and history.tokens == 200
    history.record(a, "a2", [9] * 300)  # the same response id again (a resumed request): replaced
    assert [r[0] for r in history.responses(a)] == [1, 9] and history.tokens == 400
    history.record(b, "b0", [7] * 500)
    assert history.tokens == 900
    history.record(b, "b1", [8] * 400)  # past 1000: the least recently used prompt (a) goes, oldest first
    assert history.tokens == 900 and history.prompts == 1 and history.responses(a) == []
    history.record(b, "b2", [6] * 1001)  # longer than the whole bound: not kept
    assert history.tokens == 900
    assert [r[0] for r in history.responses(b, exclude="b1")] == [7]


def test_equal_prompts_share_a_history_key_and_different_ones_do_not():
    assert prompt_digest([1, 2, 3]) == prompt_digest(np.array([1, 2, 3], dtype=np.int64))
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    # An engine's int32 row is hashed as it is: the key is BLAKE2b-128 of its bytes.
    row = np.arange(4096, dtype=np.int32)
    assert prompt_digest(row) == hashlib.blake2b(row.tobytes(), digest_size=16).digest() == prompt_digest(row.tolist())


def test_a_group_counts_once_per_rollout_though_its_probe_ends_before_its_siblings_start() -> None:
    """The hit counter behind samrollout_drafter_history_hit_groups_total: a group is counted when its first
    request reaches the drafter, a hit when its prompt's earlier responses are in the history then.  Under
    length-aware scheduling a group's probe may end before its siblings start (its automaton is freed in
    between): with a rollout id the group is still counted once, and not as a hit of its own probe."""
    config = SpeculationConfig()
    session = DraftSession(config, VOCAB, SessionSettings(largest_draft=config.largest_draft(), confident_k=3))

    def row(request_id: str, group: str | None, rollout: str | None) -> StepRow:
        tokens = [*PROMPT, 7]
        return StepRow(request_id, 1, tokens, len(tokens), len(PROMPT), group=group, rollout=rollout)

    def counts() -> tuple[int, int]:
        history = session.stats().history
        assert history is not None
        return history.groups, history.hit_groups

    session.step([row("probe", "r0.g0", "r0")], ["probe"])
    session.step([], [])  # the probe ended: its response is in the history, its group's automaton gone
    session.step([row("sibling-1", "r0.g0", "r0"), row("sibling-2", "r0.g0", "r0")], ["sibling-1", "sibling-2"])
    assert counts() == (1, 0)
    session.step([row("next-step", "r1.g0", "r1")], ["next-step"])
    assert counts() == (2, 1)
    session.step([row("plain", None, None)], ["plain"])  # no group or rollout id: grouped by its prompt
    assert counts() == (3, 2)


def test_replay_with_history_accepts_more_than_without_on_the_same_rollout():
    from samrollout.replay.simulate import replay
    from samrollout.replay.traces import TraceGroup

    earlier = np.array(_no_loop(300, seed=4), dtype=np.int32)
    later = earlier.copy()
    later[150:] = _no_loop(150, seed=5)  # the later response follows the earlier one for half its length
    group = TraceGroup("p", np.array(PROMPT, dtype=np.int32), [later])
    with_history = SamReplayDrafter("sam-history", VOCAB, group=True, history_tokens=1 << 20)
    results = [replay(drafter, [group], k=3, threshold=None, history=[[earlier]])
               for drafter in (SamReplayDrafter("sam-group", VOCAB, group=True), with_history)]
    assert results[0].accepted == 0
    assert results[1].accepted >= 110  # the shared half: 3 drafted and accepted of every 4 tokens


def test_history_is_on_by_default_bounded_and_can_be_turned_off():
    on = ServerSettings().speculation_config("cpu")
    assert on is not None and on.history_tokens == SpeculationConfig().history_tokens > 0
    off = ServerSettings(draft_history_tokens=0, draft_history_responses=2).speculation_config("cpu")
    assert off is not None and off.history_tokens == 0 and off.history_responses == 2
    assert SpeculationConfig.from_json(off.to_json()) == off
    with pytest.raises(ValueError):
        SpeculationConfig(history_tokens=-1)
    with pytest.raises(ValueError):
        SpeculationConfig(history_responses=0)


def _greedy(server: ServerProcess, prompt: str, tokens: int) -> list[int]:
    reply = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    token_ids: list[int] = reply.json()["choices"][0]["token_ids"]
    return token_ids


def test_a_second_rollout_of_a_prompt_joins_the_first_rollouts_response_and_keeps_its_output(
        tiny_server: ServerProcess) -> None:
    def history() -> HistoryStats:
        result = ProposerStats.from_json(admin_status(tiny_server)["drafter"]).history
        assert result is not None, "history is on by default"
        return result

    first = _greedy(tiny_server, "an epoch revisits this prompt", 64)
    joined = history().joined_responses
    second = _greedy(tiny_server, "an epoch revisits this prompt", 64)
    after = history()
    assert second == first  # drafts only: the output is the model's
    assert after.joined_responses >= joined + 1
    assert 64 <= after.tokens <= after.max_tokens


# Past the threshold only confident drafts run (a match of 8+ tokens); the second pass of the same twelve
# prompts runs all twelve at once, never in the tail (one running), so its groups must join their history
# while the batch is big for those drafts to see it.
CONFIDENT_PAST_THE_THRESHOLD = {"k": 3, "threshold_mode": "static", "draft_range": [[1, 3]], "confident_match": 8,
                                "policy": {"min_match_length": 1}}
HISTORY_PROMPTS = [f"Epoch prompt {i}: list the steps to solve problem {i * 7} carefully." for i in range(12)]


HISTORY_JOBS = [{"name": name, "prompts": HISTORY_PROMPTS, "params": {"temperature": 0, "max_tokens": 64,
                                                                      "ignore_eos": True}}
                for name in ("first", "again")]


def engine_plan(tiny_dir: Path, smollm2_dir: Path, base: Path) -> dict[str, EngineRun]:
    """The history test's engine, run in the exactness modules' pool (`planned_engine_runs`)."""
    return {"history": EngineRun(tiny_dir, CONFIDENT_PAST_THE_THRESHOLD, HISTORY_JOBS, base / "history",
                                 expected_s=25.0)}


def test_with_confident_drafts_past_the_threshold_earlier_responses_join_while_the_batch_is_big(
        planned_engine_runs: dict[str, Any]) -> None:
    run = planned_runs(planned_engine_runs, __name__)["history"]
    first, again = ([c["token_ids"] for choices in run["results"][job] for c in choices] for job in ("first", "again"))
    assert again == first  # drafts only: the outputs are the model's
    proposer = ProposerStats.from_json(run["proposer"])
    assert proposer.history is not None and proposer.history.joined_responses >= len(HISTORY_PROMPTS)
    assert proposer.confident_drafts > 0 and proposer.sources["group"].accepted_tokens > 0
