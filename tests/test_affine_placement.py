"""History-affine placement (`samrollout_client.placement`): a prompt keeps its server across steps, a server
joining or leaving moves about 1/N of the prompts, no server takes more than 1.25x its share, a down server's
prompts go to their next choice and come back.  Also the placement policies behind one protocol, and the one
stickiness rule of the veRL router and the AReaL engine (`StickyGroups`).

The client's end-to-end behaviour on real servers (same server every step, failover and recovery) is in
tests/test_client.py, the veRL router's in tests/test_verl_backend.py, the servers' hit counter in
tests/test_server_metrics.py.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from samrollout_client.placement import (
    AFFINE_LOAD_FACTOR,
    BATCH_LOAD_FACTOR,
    DEFAULT_PLACEMENT,
    PLACEMENTS,
    GroupDemand,
    LeastOutstandingPlacement,
    StickyGroups,
    affine_load_bound,
    least_loaded,
    place_affine,
    place_by_predicted_work,
    place_groups,
    placement_policy,
    plan_affine,
    register_placement,
    rendezvous_ranking,
    rendezvous_weight,
    work_shares,
)
from samrollout_client.protocol.prompt_identity import prompt_id

PROMPTS = [prompt_id(f"Question {i}: what is {i} * 7?") for i in range(1000)]


def urls(count: int) -> list[str]:
    return [f"http://rollout-{i}:8000" for i in range(count)]


def first_choices(endpoints: list[str]) -> list[str]:
    """Each prompt's endpoint when it is placed alone (nothing else in flight)."""
    return [endpoints[place_affine(p, endpoints, [0] * len(endpoints), 8)] for p in PROMPTS]


def placed_together(prompts: list[str], endpoints: list[str], group: int) -> list[int]:
    """Each group's endpoint when all are placed in turn and none finishes: the loads the bound sees grow."""
    loads = [0] * len(endpoints)
    chosen = []
    for prompt in prompts:
        index = place_affine(prompt, endpoints, loads, group)
        loads[index] += group
        chosen.append(index)
    return chosen


def moved(before: list[str], after: list[str]) -> float:
    return sum(a != b for a, b in zip(before, after, strict=True)) / len(before)


def test_a_prompt_ranks_the_endpoints_alike_in_every_process() -> None:
    """The ranking is a hash of (prompt, endpoint) only: no salted hash(), no order of the list given."""
    endpoints = urls(4)
    ranking = [endpoints[i] for i in rendezvous_ranking(PROMPTS[0], endpoints)]
    assert [endpoints[::-1][i] for i in rendezvous_ranking(PROMPTS[0], endpoints[::-1])] == ranking
    # Pinned: a change of spelling would send every prompt away from the server that holds its history, and
    # clients and routers of different versions would disagree.
    assert rendezvous_weight(prompt_id("2 + 2 ="), "http://rollout-0:8000") == 0xD1661D2661C9311E
    assert rendezvous_ranking(prompt_id([1, 2, 3]), endpoints) == [3, 1, 2, 0]
    assert first_choices(endpoints) == first_choices(list(endpoints))
    assert Counter(first_choices(endpoints)).keys() == set(endpoints)  # every endpoint is someone's first choice


@pytest.mark.parametrize(("before", "after"), [(4, 5), (5, 4)])
def test_a_server_joining_or_leaving_moves_about_one_in_n_prompts(before: int, after: int) -> None:
    alone_before, alone_after = first_choices(urls(before)), first_choices(urls(after))
    share = 1 / max(before, after)
    assert moved(alone_before, alone_after) <= share + 0.03
    together_before = [urls(before)[i] for i in placed_together(PROMPTS, urls(before), 8)]
    together_after = [urls(after)[i] for i in placed_together(PROMPTS, urls(after), 8)]
    assert moved(together_before, together_after) <= share + 0.05  # the bound moves a few more


def test_when_a_server_leaves_only_its_own_prompts_move() -> None:
    five = urls(5)
    leaving = five[2]
    four = [url for url in five if url != leaving]
    before, after = first_choices(five), first_choices(four)
    assert {b for b, a in zip(before, after, strict=True) if a != b} == {leaving}
    assert sum(b == leaving for b in before) > 100  # the leaving server had its share


def test_skewed_prompts_stay_within_the_load_bound() -> None:
    """Half the groups are three hot prompts: without the bound one server would take them all."""
    endpoints = urls(4)
    prompts = [PROMPTS[i % 3] for i in range(100)] + PROMPTS[3:103]
    group = 8
    chosen = placed_together(prompts, endpoints, group)
    loads = Counter(chosen)
    share = len(prompts) * group / len(endpoints)
    assert max(loads.values()) * group <= math.ceil(AFFINE_LOAD_FACTOR * share)
    assert len(loads) == len(endpoints)
    # each group still went to the first endpoint of its ranking that had room
    running = [0] * len(endpoints)
    for prompt, index in zip(prompts, chosen, strict=True):
        bound = affine_load_bound(sum(running) + group, len(endpoints))
        ranking = rendezvous_ranking(prompt, endpoints)
        fits = [i for i in ranking if running[i] + group <= bound]
        assert index == (fits[0] if fits else min(ranking, key=running.__getitem__))
        running[index] += group


def test_a_down_endpoints_prompts_go_to_their_next_choice_and_come_back_after_it_recovers() -> None:
    endpoints = urls(4)
    down = endpoints[1]
    up = [url for url in endpoints if url != down]
    for prompt in PROMPTS[:200]:
        ranking = [endpoints[i] for i in rendezvous_ranking(prompt, endpoints)]
        while_down = up[place_affine(prompt, up, [0] * len(up), 8)]
        assert while_down == next(url for url in ranking if url != down)
        assert endpoints[place_affine(prompt, endpoints, [0] * 4, 8)] == ranking[0]  # recovered: home again


def test_the_load_bound_counts_the_group_being_placed_and_refuses_bad_arguments() -> None:
    assert affine_load_bound(40, 4) == 13  # ceil(1.25 * 10)
    assert affine_load_bound(8, 1) == 10
    assert place_affine(PROMPTS[0], ["http://only:8000"], [1000], 8) == 0  # one endpoint: trivially it
    full = urls(2)
    favourite = rendezvous_ranking(PROMPTS[0], full)[0]
    loads = [0, 0]
    loads[favourite] = 100
    assert place_affine(PROMPTS[0], full, loads, 8) == 1 - favourite  # full: the next choice
    with pytest.raises(ValueError):
        place_affine(PROMPTS[0], [], [], 1)
    with pytest.raises(ValueError):
        place_affine(PROMPTS[0], full, [0], 1)
    with pytest.raises(ValueError):
        affine_load_bound(10, 2, factor=0.5)


def test_a_batch_placed_at_once_keeps_its_prompts_on_their_servers_across_steps() -> None:
    # Group by group, the first groups of a step see a bound sized for the few placed so far and are pushed
    # off their servers, differently every step as the data loader reorders the prompts; a batch placed as
    # a whole shares the bound out over all of it, so each prompt lands where it did the step before.
    endpoints = urls(2)
    step_prompts = PROMPTS[:30]
    steps = [step_prompts, list(reversed(step_prompts)), step_prompts[10:] + step_prompts[:10]]
    homes = []
    for order in steps:
        chosen = plan_affine(order, endpoints, [0, 0], [8] * len(order))
        homes.append(dict(zip(order, chosen, strict=True)))
        assert max(Counter(chosen).values()) * 8 <= math.ceil(BATCH_LOAD_FACTOR * 8 * len(order) / 2)
    moved = sum(homes[0][p] != later[p] for later in homes[1:] for p in step_prompts)
    assert moved == 0  # (placed group by group, 8 of these 60 move)


def test_a_batch_weighed_by_its_predicted_lengths_shares_the_long_groups_out() -> None:
    # Heavy-tailed group lengths (as a reasoning step's): counted as 8 requests each, the long groups can pile
    # up on one server within the bound; weighed by the lengths the client saw before, no server takes more
    # than its bound of the step's predicted tokens, and the same prompts still land alike in any order.
    endpoints = urls(2)
    prompts = PROMPTS[:16]
    lengths = [38, 42, 42, 72, 150, 176, 193, 232, 265, 359, 482, 493, 537, 593, 603, 768]
    chosen = plan_affine(prompts, endpoints, [0, 0], [8] * len(prompts), [float(n) for n in lengths])
    tokens = [sum(n for n, c in zip(lengths, chosen, strict=True) if c == e) for e in range(2)]
    assert max(tokens) <= BATCH_LOAD_FACTOR * sum(lengths) / 2 + max(lengths) / 8
    reordered = plan_affine(list(reversed(prompts)), endpoints, [0, 0], [8] * len(prompts),
                            [float(n) for n in reversed(lengths)])
    assert list(reversed(reordered)) == chosen


def test_a_batch_of_short_groups_is_shared_out_by_requests_too() -> None:
    # Where responses are short, a server's time goes to its requests (prefill, streaming) as much as to its
    # tokens: many short groups on one server and a few long ones on the other balance the tokens and still
    # leave the first server the step's last.  Neither server takes more than its bound of the requests.
    endpoints = urls(2)
    prompts = PROMPTS[:16]
    lengths = [4, 4, 5, 5, 6, 6, 8, 8, 10, 12, 14, 16, 60, 90, 120, 128]
    chosen = plan_affine(prompts, endpoints, [0, 0], [8] * len(prompts), [float(n) for n in lengths])
    groups = Counter(chosen)
    assert max(groups.values()) * 8 <= math.ceil(BATCH_LOAD_FACTOR * 8 * len(prompts) / 2)
    tokens = [sum(n for n, c in zip(lengths, chosen, strict=True) if c == e) for e in range(2)]
    assert max(tokens) <= BATCH_LOAD_FACTOR * sum(lengths) / 2 + max(lengths)


def test_requests_in_flight_count_against_a_batch_s_bound() -> None:
    # A server still busy with an earlier batch's requests takes fewer of the new batch's groups.
    endpoints = urls(2)
    prompts = PROMPTS[:16]
    chosen = plan_affine(prompts, endpoints, [64, 0], [8] * len(prompts))
    assert Counter(chosen)[0] * 8 + 64 <= math.ceil(BATCH_LOAD_FACTOR * (64 + 8 * 16) / 2)


def test_groups_of_unknown_length_count_as_their_size() -> None:
    assert work_shares([None, None], 8) == [8.0, 8.0]
    assert work_shares([100.0, None, 300.0], 4) == [2.0, 4.0, 6.0]


def test_placements_are_policies_registered_by_name() -> None:
    assert PLACEMENTS == ("affine", "least-outstanding", "predicted-work") and DEFAULT_PLACEMENT == "affine"
    assert [placement_policy(name).name for name in PLACEMENTS] == list(PLACEMENTS)
    with pytest.raises(ValueError, match="placement must be one of"):
        placement_policy("random")
    with pytest.raises(ValueError, match="registered already"):
        register_placement(LeastOutstandingPlacement)


def test_each_policy_places_as_its_rule() -> None:
    endpoints = urls(3)
    groups = [GroupDemand(p, 8, length) for p, length in zip(PROMPTS[:12], [None, 50.0, 400.0] * 4, strict=True)]
    loads = [16, 0, 8]
    affine, least, predicted = (placement_policy(name) for name in PLACEMENTS)
    assert affine.plan(groups, endpoints, loads) == plan_affine(PROMPTS[:12], endpoints, loads, [8] * 12,
                                                                [g.predicted_length for g in groups])
    assert affine.pick(endpoints, loads, PROMPTS[0], 8, 64) == place_affine(PROMPTS[0], endpoints, loads, 8, total=64)
    assert least.plan(groups, endpoints, loads) is None  # each group as it starts
    assert least.pick(endpoints, [3, 1, 1]) == 1 == least_loaded([3, 1, 1])  # the first among equals
    assert affine.pick(endpoints, [3, 1, 1]) == 1  # no prompt: load alone
    assert predicted.plan(groups, endpoints, loads) == place_by_predicted_work([g.predicted_work for g in groups], 3)
    # all start at once, none finishes: least-outstanding alternates in the order met
    assert place_groups(least, groups[:5], urls(2), [0, 0]) == [0, 1, 0, 1, 0]
    # a recorded home is kept, and the others see its load
    assert place_groups(least, groups[:3], urls(2), [0, 0], homes=[0, None, None]) == [0, 1, 0]


def test_a_groups_requests_stay_together_while_any_is_in_flight() -> None:
    servers = urls(2)
    sticky = StickyGroups()
    home = sticky.acquire("r1", PROMPTS[0], servers)
    assert home == servers[rendezvous_ranking(PROMPTS[0], servers)[0]]
    assert [sticky.acquire(f"r{i}", PROMPTS[0], servers, loads=[100, 100]) for i in (2, 3)] == [home, home]
    assert sticky.loads(servers)[servers.index(home)] == 3
    for request in ("r1", "r2", "r3"):
        sticky.release(request)
    assert sticky.loads(servers) == [0, 0]
    loads = [0, 0]
    loads[servers.index(home)] = 100
    other = sticky.acquire("r4", PROMPTS[0], servers, loads=loads)  # forgotten: placed afresh, within the bound
    assert other != home
    sticky.release("r4")
    sticky.release("never seen")  # nothing to release: no error


def test_a_known_request_id_goes_back_to_its_server_before_its_group() -> None:
    """A later turn of a conversation keeps its server (its prefix cache) even where its prompt's group is
    elsewhere; a request id whose server left falls back to the group, and a group whose server left moves."""
    servers = urls(3)
    sticky = StickyGroups()
    home = sticky.acquire("sibling", PROMPTS[0], servers)
    elsewhere = next(s for s in servers if s != home)
    assert sticky.acquire("conversation", PROMPTS[0], servers, earlier=elsewhere) == elsewhere
    assert sticky.acquire("another", PROMPTS[0], servers) == home  # the group stays where it was
    assert sticky.acquire("conversation", PROMPTS[0], servers, earlier="http://gone:8000") == home
    rest = [s for s in servers if s != home]
    moved = sticky.acquire("late", PROMPTS[0], rest)  # its server left: the group moves with its requests
    assert moved in rest and sticky.acquire("later", PROMPTS[0], servers) == moved
    sticky.clear()
    assert sticky.loads(servers) == [0, 0, 0]
    with pytest.raises(RuntimeError):
        sticky.acquire("r", PROMPTS[0], [])
