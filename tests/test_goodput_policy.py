"""The adaptive drafting policy: draft lengths from expected goodput, acceptance and step cost learned online."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from samrollout._core import core
from samrollout.config import SpeculationConfig
from samrollout.drafter import DRAFT_SOURCES, DraftPolicy, Proposals, SamDrafter, match_bucket
from samrollout.sim.cost import CostTable
from samrollout.spec_decode.goodput import critical_weights, longest_rows
from samrollout.spec_decode.session import DraftSession, SessionSettings, StepRow
from samrollout.spec_decode.step_cost import LinearShape, StepCost, TableShape

VOCAB = 1000
H100 = "bench/results/verify-cost-h100-k24.json"


def _allocate(values: np.ndarray, weights: np.ndarray, seconds: np.ndarray) -> list[int]:
    lengths = np.zeros(len(values), dtype=np.int32)
    core.allocate(np.ascontiguousarray(values, dtype=np.float64), weights, seconds, lengths)
    return lengths.tolist()


def _rate(values: np.ndarray, weights: np.ndarray, seconds: np.ndarray, lengths: tuple[int, ...]) -> float:
    produced = weights.sum() + sum(values[r, :k].sum() for r, k in enumerate(lengths))
    return float(produced / seconds[sum(lengths)])


def test_the_chosen_draft_lengths_maximise_expected_tokens_per_second() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, depth = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        weights = rng.choice([1.0, 1.0, 4.0], size=rows)
        reach = np.cumprod(rng.random((rows, depth)) ** 0.5, axis=1)
        reach[rng.random((rows, depth)) < 0.15] = 0.0  # some rows have shorter drafts
        reach = np.where(np.cumprod(reach > 0, axis=1) > 0, reach, 0.0)
        values = weights[:, None] * reach
        # Step time: a memory-bound flat stretch, then a rising line (the shape of a GPU's verification cost).
        knee, slope = int(rng.integers(0, rows * depth + 1)), float(rng.random() * 0.3)
        seconds = 1.0 + slope * np.maximum(0, np.arange(rows * depth + 1) - knee) + 0.001 * np.arange(rows * depth + 1)
        chosen = _allocate(values, weights, seconds)
        best = max(_rate(values, weights, seconds, lengths)
                   for lengths in itertools.product(*[range(int((values[r] > 0).sum()) + 1) for r in range(rows)]))
        assert _rate(values, weights, seconds, tuple(chosen)) == pytest.approx(best)


def test_a_draft_is_sent_only_where_its_expected_tokens_pay_for_the_step_time_it_adds() -> None:
    values = np.array([[0.95, 0.9, 0.85], [0.3, 0.1, 0.03]])
    weights = np.ones(2)
    free = np.full(7, 1.0)  # verification costs nothing: every token with any chance is drafted
    assert _allocate(values, weights, free) == [3, 3]
    steep = 1.0 + 0.2 * np.arange(7)  # each draft token costs a fifth of a step: only near-certain ones pay
    assert _allocate(values, weights, steep) == [3, 0]
    prohibitive = 1.0 + 2.0 * np.arange(7)
    assert _allocate(values, weights, prohibitive) == [0, 0]  # the threshold: nothing drafts


def test_match_lengths_are_bucketed_by_half_octaves() -> None:
    lengths = [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 16, 24, 1 << 20]
    assert [match_bucket(m) for m in lengths] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 8, 9, int(core.MATCH_BUCKETS) - 1]


def _session(max_draft: int = 16, cost: str = "linear", proposals: Proposals = "copies") -> DraftSession:
    config = SpeculationConfig(max_draft=max_draft, cost_prior=cost, history_tokens=0,
                               policy=DraftPolicy(min_match_length=1, proposals=proposals))
    return DraftSession(config, VOCAB, SessionSettings(largest_draft=max_draft, confident_k=3))


def _run(session: DraftSession, truths: dict[str, list[int]], prompt: int, steps: int,
         seconds: Callable[[int, int], float], groups: dict[str, str] | None = None) -> list[list[list[int]]]:
    """Step ``session`` over rows replaying ``truths`` (each row's whole sequence), advancing each row by what its
    draft got right plus one, with ``seconds(rows, tokens verified)`` per step; every step's drafts."""
    return _replay(session, truths, prompt, steps, seconds, groups)[0]


def _replay(session: DraftSession, truths: dict[str, list[int]], prompt: int, steps: int,
            seconds: Callable[[int, int], float], groups: dict[str, str] | None = None,
            told: Callable[[int, int], float] | None = None) -> tuple[list[list[list[int]]], list[tuple[float, int]]]:
    """`_run`, and after each step the device's time so far and the tokens produced so far; ``told``: the step
    times the session is shown instead of the device's (a policy that does not see the device's cost)."""
    at = {r: prompt for r in truths}
    drafts: dict[str, list[int]] = {}
    now = shown = 0.0
    every: list[list[list[int]]] = []
    clock: list[tuple[float, int]] = []
    for step in range(steps):
        rows = []
        for request_id, truth in truths.items():
            draft = drafts.get(request_id, [])
            accepted = next((i for i, t in enumerate(draft) if truth[at[request_id] + i] != t), len(draft))
            got = 0 if step == 0 else accepted + 1
            at[request_id] += got
            rows.append(StepRow(request_id, got if step else 1, truth, at[request_id], prompt,
                                (groups or {}).get(request_id)))
        verified = sum(len(d) for d in drafts.values()) + len(truths)
        now += seconds(len(truths), verified)
        shown += (told or seconds)(len(truths), verified)
        clock.append((now, sum(at.values())))
        every.append(session.step(rows, set(truths), now=shown))
        drafts = dict(zip(truths, every[-1], strict=True))
    return every, clock


def test_a_looping_response_drafts_long_at_full_batch_where_guesses_draft_nothing() -> None:
    rng = np.random.default_rng(1)
    prompt = list(rng.integers(0, VOCAB, 32))
    loop = prompt + [7, 8, 9, 10, 11, 12] * 400
    truths = {"loop": loop, **{f"r{i}": prompt + list(rng.integers(0, VOCAB, 2400)) for i in range(47)}}
    # A compute-bound device: a draft token costs as much as a row's token (its step has 48 rows).
    session = _session()
    steps = _run(session, truths, len(prompt), 120, lambda rows, tokens: 0.002 + 0.001 * tokens)
    assert all(len(step[0]) == 16 for step in steps[-20:])  # the loop is accepted in full: it pays at any batch size
    assert all(draft == [] for step in steps[-20:] for draft in step[1:])  # random text: a draft there is a guess
    assert session.stats().step_cost["<64"][3] > 100  # the engine's own steps measured...
    assert session.goodput is not None  # ...and the line learned where the policy works: 48 rows, 64 tokens
    assert session.goodput.cost.seconds(48, np.array([64.0]), 2000.0) == pytest.approx([0.066], rel=0.05)


def test_on_a_memory_bound_device_every_row_drafts_what_its_match_supports() -> None:
    rng = np.random.default_rng(2)
    prompt = list(rng.integers(0, VOCAB, 32))
    phrase = list(rng.integers(0, VOCAB, 40))
    # Four rows writing the same phrases in a different order: their matches are real but break at the joins.
    truths = {f"r{i}": prompt + [t for j in rng.permutation(150) for t in phrase[j % 5 * 8:j % 5 * 8 + 8]]
              for i in range(4)}
    free = _run(_session(), truths, len(prompt), 60, lambda rows, tokens: 0.010)  # verification costs nothing
    compute_bound = _run(_session(), truths, len(prompt), 60, lambda rows, tokens: 0.001 * tokens)
    def drafted(steps: list[list[list[int]]]) -> float:
        return sum(len(draft) for step in steps[-30:] for draft in step) / (30 * len(truths))
    assert drafted(free) > 6 and drafted(free) > 2.5 * drafted(compute_bound)


def test_every_source_is_scored_whether_its_draft_was_sent_or_not() -> None:
    drafter = SamDrafter(VOCAB, DraftPolicy(min_match_length=1))
    text = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    drafter.add_request("a", text[:8], group="g")
    drafter.add_request("b", text[:8], group="g")
    seconds = np.full(2 * 8 + 1, 1.0)
    def step(tokens: list[list[int]], limits: list[int]) -> None:
        drafter.step_goodput(["a", "b"], tokens, 8, np.ones(2, dtype=np.uint8), np.array(limits, dtype=np.int32),
                             np.ones(2), seconds)
    step([text[8:16], text[8:12]], [8, 8])  # both have own and group candidates now
    step([text[16:18], text[12:14]], [8, 0])  # b may not draft: its candidates are not scored next step
    seen, _ = drafter.acceptance_table()
    scored = seen.sum(axis=1)
    assert scored[DRAFT_SOURCES.index("own")] > 0 and scored[DRAFT_SOURCES.index("group")] > 0
    step([text[18:19], text[14:15]], [8, 8])
    after, _ = drafter.acceptance_table()
    assert after.sum() - seen.sum() == pytest.approx(2.0, abs=0.1)  # a's two candidates only (decay aside)


def test_without_a_table_the_step_cost_is_learned_from_the_engines_own_steps() -> None:
    cost = StepCost(LinearShape())
    truth = lambda rows, tokens: 0.050 + 0.0020 * tokens  # noqa: E731  (a device unlike the line's defaults)
    rng = np.random.default_rng(3)
    for _ in range(400):
        rows = int(rng.integers(1, 64))
        tokens = rows if rng.random() < 0.3 else rows + int(rng.integers(1, rows * 4 + 1))
        cost.observe(rows, tokens, 1000.0, truth(rows, tokens))
    for rows in (2, 16, 48):
        predicted = cost.seconds(rows, np.array([rows, rows * 3], dtype=np.float64), 1000.0)
        assert predicted == pytest.approx([truth(rows, rows), truth(rows, rows * 3)], rel=0.1)


def test_a_table_measured_on_the_device_itself_is_left_as_it_is() -> None:
    table = CostTable.load(H100)
    cost = StepCost(TableShape(table))
    for rows, tokens_per_row in [(8, 1.0), (8, 4.0), (32, 2.0), (32, 9.0), (64, 1.0), (64, 5.0)] * 20:
        cost.observe(rows, int(rows * tokens_per_row), 4096.0, table.step_seconds(rows, tokens_per_row, 4096.0))
    for rows in (8, 32, 64):
        u, w, v, _ = cost.describe()[f"<{1 << rows.bit_length()}"]
        assert (u, w, v) == (pytest.approx(1.0, abs=0.02), pytest.approx(0.0, abs=0.02), pytest.approx(1.0, abs=0.05))


def test_only_rows_longer_than_every_other_are_the_critical_path() -> None:
    assert longest_rows([50, 90, 70, 70], 2) == [1]  # 70 and 70 started together: neither is evidence
    assert longest_rows([50, 90, 80, 70], 2) == [1, 2]
    assert critical_weights([50, 90, 80, 70], 2, 16.0).tolist() == [1.0, 16.0, 16.0, 1.0]
    assert critical_weights([50, 90], 2, 16.0).tolist() == [1.0, 1.0]  # every row critical: nothing to favour


def _tokens_per_second(proposals: Proposals | None, seconds: Callable[[int, int], float],
                       told: Callable[[int, int], float] | None = None) -> float:
    """Eight rows of random text where a 5 is always followed by a 6 (every sixth token): the device's tokens per
    second over the last 100 of 200 steps with the adaptive policy (``proposals``; None: nothing drafted)."""
    rng = np.random.default_rng(4)
    prompt = list(rng.integers(0, VOCAB, 32))
    truths = {f"r{i}": prompt + [t for _ in range(200) for t in [*rng.integers(0, VOCAB, 4).tolist(), 5, 6]]
              for i in range(8)}
    session = _session(proposals=proposals or "copies")
    if proposals is None:
        session.step = lambda rows, *_, **__: [[] for _ in rows]  # type: ignore[method-assign]
    _, clock = _replay(session, truths, len(prompt), 200, seconds, told=told)
    (start, made), (end, total) = clock[99], clock[-1]
    return (total - made) / (end - start)


def _plain_step(rows: int, tokens: int) -> float:
    return 0.030 + 0.0004 * tokens


def _switch_step(rows: int, tokens: int) -> float:
    """A step on vLLM's CPU backend: one that verifies any sampled draft runs its rejection sampler, which costs
    about a plain step whatever the drafts."""
    return _plain_step(rows, tokens) + (0.030 if tokens > rows else 0.0)


@pytest.mark.parametrize("proposals", ["copies", "counted"])
def test_a_device_where_any_draft_costs_a_switch_learns_it_and_drafting_never_costs_throughput(
        proposals: Proposals) -> None:
    # Where drafts are cheap the sure 6 after a 5 pays; where any draft costs as much as a plain step, drafting
    # pays at best when every row drafts at once: the policy learns the switch and delivers what not drafting does.
    undrafted = _tokens_per_second(None, _plain_step)
    assert _tokens_per_second(None, _switch_step) == pytest.approx(undrafted)
    assert _tokens_per_second(proposals, _plain_step) > 1.1 * undrafted
    assert _tokens_per_second(proposals, _switch_step) > 0.98 * undrafted


def test_a_policy_shown_a_cost_without_the_switch_loses_throughput_on_a_device_with_one() -> None:
    # What the test above guards against: drafting as if the switch were free.
    undrafted = _tokens_per_second(None, _switch_step)
    assert _tokens_per_second("copies", _switch_step, told=_plain_step) < 0.9 * undrafted
