"""Which endpoint a prompt group goes to: one policy object per rule, registered by name, used by every caller.

Every place that decides where a group runs goes through this module: the client
(`samrollout_client.client`), the veRL router and the AReaL engine (`StickyGroups`), the
simulators (``samrollout simulate``, ``samrollout simulate-rl``) and bench/scheduling.py.  A
placement is a `PlacementPolicy`: ``plan`` places a step's batch as a whole (or leaves each group
to ``pick``), ``pick`` places one group from the endpoints' loads, the requests the caller keeps in
flight and the group's own requests.  A new placement is one class here, registered with
`register_placement` under its ``name`` (`PLACEMENTS`, `placement_policy`).

``affine`` (the default) sends a prompt to the same endpoint every step, so that the
server finds its earlier responses in its cross-epoch draft history and its length
history (each server keeps its own): rendezvous (highest-random-weight) hashing of the
prompt's identity (`samrollout_client.protocol.prompt_identity`, what the server keys its history
by) with bounded loads.  Endpoints are ranked by a stable hash of (prompt identity,
endpoint); the group goes to the highest-ranked endpoint that is up and would stay within
`AFFINE_LOAD_FACTOR` (1.25) times its share of the requests in flight, this group
included (`affine_load_bound`), else down the ranking; when every endpoint is past the
bound (a few groups in flight), to the least loaded.  A step's batch is placed as a whole
(`plan_affine`) within `BATCH_LOAD_FACTOR` (1.1) of each endpoint's share of the
requests and of the predicted work (each group weighed by its predicted length when the
client has seen the prompt, `work_shares`), so that a step's long groups do not pile up
on one endpoint.  A server joining or leaving moves about 1/N of the prompts (only the
leaving server's prompts, when loads are light).

``least-outstanding`` sends each group to the endpoint with the fewest requests in flight
from this client (`least_loaded`).  ``predicted-work`` remembers how long the responses
to each prompt were in earlier rollouts (`LengthHistory`, LRU-bounded) and places the
groups longest first, each onto the endpoint with the least predicted work (tokens)
assigned so far: the longest-processing-time rule, so that no endpoint is left alone with
the long groups at the end of a step.  Prompts never seen before count as the mean of the
known ones.

Routers that see a group's requests one at a time (veRL's, AReaL's) keep them together by one
rule, `StickyGroups`: a request id seen before goes back to its server, else a request joins its
prompt's group while any of the group is in flight, else the policy places it.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from samrollout_client.protocol.prompt_identity import prompt_id

Placement = str  # the name of a registered placement (`PLACEMENTS`): a new one is a class, not a new literal

# The most an endpoint may hold under ``affine`` placement, as a multiple of its share of the work in flight
# (consistent hashing with bounded loads, Mirrokni et al. 2018; HAProxy's hash-balance-factor 125).
AFFINE_LOAD_FACTOR = 1.25
# The bound of a batch placed as a whole (`plan_affine`): it sees all of its work at once, so it can share it
# out closely without moving a prompt by the accident of arrival order; the same prompts land alike every
# step, and a step's makespan is set by its most loaded endpoint (bench/scheduling.py: 1.25 left one of two
# servers 1.1-1.3x its share of the tokens, about 12% longer steps than least-outstanding).
BATCH_LOAD_FACTOR = 1.1
# BLAKE2b personalisation of the rendezvous weights: no other hash in samrollout collides with them by design.
_RENDEZVOUS_PERSON = b"samrollout.hrw"


class LengthHistory:
    """Mean response length per prompt from earlier rollouts, for at most ``max_prompts`` prompts (LRU).

    Prompts are told apart by their identity (`samrollout_client.protocol.prompt_identity`): a prompt given as text
    and the same prompt given as token ids are two prompts here.
    """

    def __init__(self, max_prompts: int = 65536) -> None:
        if max_prompts < 1:
            raise ValueError(f"max_prompts must be at least 1, got {max_prompts}")
        self.max_prompts = max_prompts
        self._lengths: OrderedDict[str, float] = OrderedDict()

    def record(self, prompt: str | list[int], lengths: Sequence[int]) -> None:
        """Remember the mean of ``lengths`` (one group's responses, in tokens) for ``prompt``."""
        if not lengths:
            return
        key = prompt_id(prompt)
        self._lengths.pop(key, None)
        self._lengths[key] = sum(lengths) / len(lengths)
        while len(self._lengths) > self.max_prompts:
            self._lengths.popitem(last=False)

    def predict(self, prompt: str | list[int]) -> float | None:
        """The remembered mean length of ``prompt``'s responses, or None."""
        return self._lengths.get(prompt_id(prompt))

    def __len__(self) -> int:
        return len(self._lengths)


def least_loaded(loads: Sequence[float]) -> int:
    """The index of the smallest of ``loads``, the first among equals: the least-outstanding choice.

    Every "fewest requests in flight" in samrollout is this one function, so that ties break alike everywhere.
    """
    if not loads:
        raise ValueError("at least one endpoint is needed")
    return min(range(len(loads)), key=loads.__getitem__)


def place_by_predicted_work(predicted: Sequence[float | None], endpoints: int,
                            load: Sequence[float] | None = None) -> list[int]:
    """An endpoint index per group: longest predicted group first, onto the least loaded endpoint.

    ``predicted`` is each group's predicted work (None: unknown, counted as the mean of the
    known ones, or 1 when none is known); ``load`` is work already on each endpoint.
    """
    if endpoints < 1:
        raise ValueError("at least one endpoint is needed")
    known = [p for p in predicted if p is not None]
    default = sum(known) / len(known) if known else 1.0
    work = [default if p is None else p for p in predicted]
    totals = list(load) if load is not None else [0.0] * endpoints
    chosen = [0] * len(work)
    for group in sorted(range(len(work)), key=lambda g: (-work[g], g)):
        target = least_loaded(totals)
        chosen[group] = target
        totals[target] += work[group]
    return chosen


def rendezvous_weight(identity: str, endpoint: str) -> int:
    """The stable weight of ``endpoint`` for the prompt ``identity``: the higher, the more the prompt prefers it.

    64 bits of BLAKE2b over both strings (never Python's salted ``hash``), so every process, client
    and router ranks the endpoints of a prompt alike.
    """
    data = identity.encode("utf-8", "surrogatepass") + b"\x00" + endpoint.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_RENDEZVOUS_PERSON).digest(), "big")


def rendezvous_ranking(identity: str, endpoints: Sequence[str]) -> list[int]:
    """The indices of ``endpoints``, the prompt ``identity``'s first choice first (rendezvous hashing).

    Removing an endpoint leaves the order of the others unchanged; adding one inserts it somewhere.
    """
    return sorted(range(len(endpoints)), key=lambda i: (-rendezvous_weight(identity, endpoints[i]), endpoints[i]))


def affine_load_bound(total: float, endpoints: int, factor: float = AFFINE_LOAD_FACTOR) -> int:
    """The most work one of ``endpoints`` may hold: ``ceil(factor * total / endpoints)``.

    ``total`` is the work in flight on those endpoints, the group being placed included.
    """
    if endpoints < 1:
        raise ValueError("at least one endpoint is needed")
    if factor < 1:
        raise ValueError(f"the load factor must be at least 1, got {factor}")
    return math.ceil(factor * total / endpoints)


def place_affine(identity: str, endpoints: Sequence[str], loads: Sequence[float], work: float = 1.0,
                 factor: float = AFFINE_LOAD_FACTOR, total: float | None = None) -> int:
    """The index of the endpoint for ``work`` more requests of the prompt ``identity`` (rendezvous, bounded loads).

    ``endpoints`` are the candidates (those up), ``loads`` the work each holds now.  The first
    endpoint of the prompt's `rendezvous_ranking` that stays within `affine_load_bound` once it
    takes ``work``; when none would (fewer groups in flight than it takes to share them out),
    the least loaded, the prompt's earlier choice first among equals.  ``total``: the work the
    bound shares out (default: the loads and ``work``); a batch placed group by group passes the
    whole batch's, so that its first groups are not pushed off their endpoints by a bound sized
    for the few placed so far (`plan_affine`).
    """
    if len(loads) != len(endpoints):
        raise ValueError(f"{len(endpoints)} endpoints but {len(loads)} loads")
    ranking = rendezvous_ranking(identity, endpoints)
    if not ranking:
        raise ValueError("at least one endpoint is needed")
    bound = affine_load_bound(max(sum(loads) + work, total or 0.0), len(endpoints), factor)
    for index in ranking:
        if loads[index] + work <= bound:
            return index
    return ranking[least_loaded([loads[index] for index in ranking])]


def work_shares(predicted: Sequence[float | None], group_size: int) -> list[float]:
    """Each group's work in requests, so that it adds up with the requests in flight: ``group_size`` scaled by
    its predicted response length (`LengthHistory`) over the mean prediction of the batch.

    A group of unknown length counts as ``group_size``; so does every group when none is known.
    """
    known = [p for p in predicted if p is not None and p > 0]
    if not known:
        return [float(group_size)] * len(predicted)
    mean = sum(known) / len(known)
    return [group_size * (p / mean if p is not None and p > 0 else 1.0) for p in predicted]


def plan_affine(identities: Sequence[str], endpoints: Sequence[str], loads: Sequence[float],
                sizes: Sequence[float], predicted: Sequence[float | None] | None = None,
                factor: float = BATCH_LOAD_FACTOR) -> list[int]:
    """An endpoint index per group of a batch placed at once: the first endpoint of the prompt's
    `rendezvous_ranking` that stays within ``factor`` (default `BATCH_LOAD_FACTOR`) of its share of the
    requests and of the predicted work, else the one it overfills least.

    ``loads`` are the requests each endpoint holds in flight (they count as requests of mean length),
    ``sizes`` each group's requests, ``predicted`` each prompt's predicted response length (`LengthHistory`;
    None: unknown, counted as the batch's mean, `work_shares`).  Both bounds, because a step's makespan is
    set by its most loaded endpoint, in tokens where responses are long and in requests (prefill, streaming)
    where they are short.  The groups are placed in an order of their own, not the batch's: the strongest
    preferences first (the largest gap between a prompt's first and second endpoint weights), so that the
    same prompts land alike however a data loader orders them, and those that give way are the ones that
    care least."""
    if len(identities) != len(sizes):
        raise ValueError(f"{len(identities)} groups but {len(sizes)} sizes")
    if predicted is not None and len(predicted) != len(sizes):
        raise ValueError(f"{len(sizes)} groups but {len(predicted)} predicted lengths")
    if len(loads) != len(endpoints):
        raise ValueError(f"{len(endpoints)} endpoints but {len(loads)} loads")
    works = _scaled_works(sizes, predicted)
    requests, work = list(loads), list(loads)
    request_bound = affine_load_bound(sum(loads) + sum(sizes), len(endpoints), factor)
    work_bound = affine_load_bound(sum(loads) + sum(works), len(endpoints), factor)
    chosen = [0] * len(identities)
    for g in sorted(range(len(identities)), key=lambda g: (-_preference(identities[g], endpoints), identities[g])):
        def overfill(index: int, g: int = g) -> float:
            return max((requests[index] + sizes[g]) / request_bound, (work[index] + works[g]) / work_bound)
        ranking = rendezvous_ranking(identities[g], endpoints)
        index = next((i for i in ranking if overfill(i) <= 1.0), None)
        if index is None:
            index = min(ranking, key=overfill)
        requests[index] += sizes[g]
        work[index] += works[g]
        chosen[g] = index
    return chosen


def _scaled_works(sizes: Sequence[float], predicted: Sequence[float | None] | None) -> list[float]:
    """Each group's predicted work in requests of the batch's mean length (`work_shares`, per group size)."""
    if predicted is None:
        return [float(size) for size in sizes]
    return [share * size for share, size in zip(work_shares(predicted, 1), sizes, strict=True)]


def _preference(identity: str, endpoints: Sequence[str]) -> int:
    """How strongly the prompt prefers its first endpoint: its weight there less its second best (one endpoint: 0)."""
    weights = sorted((rendezvous_weight(identity, e) for e in endpoints), reverse=True)
    return weights[0] - weights[1] if len(weights) > 1 else 0


# --- policies ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupDemand:
    """One prompt group to place: the prompt's identity (`samrollout_client.protocol.prompt_identity`), its requests,
    and the mean response length its prompt had before (`LengthHistory`; None: not seen)."""

    identity: str
    requests: float
    predicted_length: float | None = None

    @property
    def predicted_work(self) -> float | None:
        """The group's predicted tokens (its requests times the predicted length), or None when not known."""
        return None if self.predicted_length is None else self.predicted_length * self.requests


class PlacementPolicy(Protocol):
    """A placement: where a step's batch of groups goes, and where one group goes as it starts.

    ``endpoints`` are the candidates (those up) by name, ``loads`` the requests each holds in flight (the
    caller's own); both methods answer with indices into ``endpoints``.
    """

    name: ClassVar[str]

    def plan(self, groups: Sequence[GroupDemand], endpoints: Sequence[str],
             loads: Sequence[float]) -> list[int] | None:
        """An endpoint per group of a batch placed as a whole, or None: each group is `pick`ed as it starts."""
        ...

    def pick(self, endpoints: Sequence[str], loads: Sequence[float], identity: str | None = None,
             requests: float = 1.0, in_flight: float | None = None) -> int:
        """The endpoint for ``requests`` more requests of the prompt ``identity`` (None: no prompt, load alone);
        ``in_flight``: the requests the caller will keep in flight, which a load bound may share out."""
        ...


PolicyClass = TypeVar("PolicyClass", bound=type[PlacementPolicy])
_REGISTRY: dict[str, type[PlacementPolicy]] = {}


def register_placement(policy: PolicyClass) -> PolicyClass:
    """Make ``policy`` a placement every caller can name (its ``name``: `PLACEMENTS`, `placement_policy`)."""
    if policy.name in _REGISTRY:
        raise ValueError(f"placement {policy.name!r} is registered already")
    _REGISTRY[policy.name] = policy
    return policy


def placement_policy(name: Placement) -> PlacementPolicy:
    """The placement registered as ``name``; ValueError naming the choices for any other name."""
    if name not in _REGISTRY:
        raise ValueError(f"placement must be one of {tuple(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]()


@register_placement
class AffinePlacement:
    """``affine``: a prompt's own endpoint every step (rendezvous hashing), within a load bound (see the module).

    A batch: `plan_affine` (its requests and predicted work each within `BATCH_LOAD_FACTOR` of a share); one
    group: `place_affine` (within `AFFINE_LOAD_FACTOR` of a share of the requests in flight); a request of
    no prompt: the least loaded.
    """

    name: ClassVar[str] = "affine"

    def plan(self, groups: Sequence[GroupDemand], endpoints: Sequence[str],
             loads: Sequence[float]) -> list[int] | None:
        """The batch by `plan_affine`, each group weighed by its predicted length."""
        return plan_affine([g.identity for g in groups], endpoints, loads, [g.requests for g in groups],
                           [g.predicted_length for g in groups])

    def pick(self, endpoints: Sequence[str], loads: Sequence[float], identity: str | None = None,
             requests: float = 1.0, in_flight: float | None = None) -> int:
        """The prompt's first endpoint within the bound (`place_affine`), the bound shared over ``in_flight``."""
        if identity is None:
            return least_loaded(loads)
        return place_affine(identity, endpoints, loads, requests, total=in_flight)


@register_placement
class LeastOutstandingPlacement:
    """``least-outstanding``: each group, as it starts, to the endpoint with the fewest requests in flight."""

    name: ClassVar[str] = "least-outstanding"

    def plan(self, groups: Sequence[GroupDemand], endpoints: Sequence[str],
             loads: Sequence[float]) -> list[int] | None:
        """None: the loads a group sees are those when it starts."""
        return None

    def pick(self, endpoints: Sequence[str], loads: Sequence[float], identity: str | None = None,
             requests: float = 1.0, in_flight: float | None = None) -> int:
        """The least loaded endpoint (`least_loaded`)."""
        return least_loaded(loads)


@register_placement
class PredictedWorkPlacement(LeastOutstandingPlacement):
    """``predicted-work``: a batch longest predicted group first onto the endpoint with the least predicted work
    (`place_by_predicted_work`); a group placed alone (a retry, a partial rollout's), least-outstanding."""

    name: ClassVar[str] = "predicted-work"

    def plan(self, groups: Sequence[GroupDemand], endpoints: Sequence[str],
             loads: Sequence[float]) -> list[int] | None:
        """The batch's predicted tokens shared out from empty endpoints: ``loads`` count requests, not tokens."""
        return place_by_predicted_work([g.predicted_work for g in groups], len(endpoints))


PLACEMENTS: tuple[Placement, ...] = tuple(_REGISTRY)
DEFAULT_PLACEMENT: Placement = AffinePlacement.name


def place_groups(policy: PlacementPolicy, groups: Sequence[GroupDemand], endpoints: Sequence[str],
                 loads: Sequence[float], in_flight: float | None = None,
                 homes: Sequence[int | None] | None = None) -> list[int]:
    """Every group's endpoint when all start now and none finishes: the policy's plan of the batch where it has
    one, else group by group, each seeing the loads of those before it.

    ``homes``: an endpoint a group must run on (None: placement decides); with any home, or with ``in_flight``
    (the requests the caller keeps in flight, shared out by a load bound), the groups go one by one.
    """
    if in_flight is None and not any(home is not None for home in homes or ()):
        planned = policy.plan(groups, endpoints, loads)
        if planned is not None:
            return planned
    running = list(loads)
    total = max(sum(running) + sum(g.requests for g in groups), in_flight or 0.0)
    chosen = []
    for index, group in enumerate(groups):
        home = homes[index] if homes is not None else None
        target = home if home is not None else policy.pick(endpoints, running, group.identity, group.requests, total)
        running[target] += group.requests
        chosen.append(target)
    return chosen


# --- keeping a group's requests together ------------------------------------------------------------------------


@dataclass
class _GroupHome:
    """Where a prompt group's requests go, and how many of them are in flight."""

    server: str
    in_flight: int = 0


class StickyGroups:
    """Where a router that sees a group's requests one at a time sends each: the one stickiness rule of veRL's
    router (`samrollout_client.verl.router`) and AReaL's engine (`samrollout_client.areal.engine`).

    A request goes, in this order:

    1. where its request id went before (``earlier``), while that server is up.  A request id names a
       conversation: veRL's agent loop sends every turn of one under one id, and both frameworks keep an id's
       server so that the conversation's earlier turns, its prompt's prefix, are in that server's KV cache;
       the saving grows with every turn.
    2. else where its prompt's group is, while any request of the group is in flight (and its server up): GRPO
       siblings come with fresh request ids and one prompt, and draft from one another on one server.
    3. else where the placement policy picks (``affine``: the prompt's own server within the load bound).

    A group is where its first request went (by 1 or 3), and moves only when that server leaves.

    The request id wins because the two disagree only when a later turn's prompt is, token for token, a prompt
    in flight on another server: there the conversation's cached prefix is certain work saved, a sibling's
    drafts a chance of some.  A group is forgotten once none of its requests is in flight: nothing to size or
    clear, every new group is placed within the load bound, and the affine hash brings a prompt back to its
    server anyway.  Releases are by request id (`release`), as veRL reports them.
    """

    def __init__(self, policy: PlacementPolicy | None = None) -> None:
        self.policy = policy or placement_policy(DEFAULT_PLACEMENT)
        self._groups: dict[str, _GroupHome] = {}
        self._requests: dict[str, list[tuple[str, str]]] = {}  # request id -> (group, server) of each in flight
        self._in_flight: Counter[str] = Counter()  # server -> requests in flight

    def acquire(self, request_id: str, group: str, servers: Sequence[str], loads: Sequence[float] | None = None,
                earlier: str | None = None) -> str:
        """The server for a request of the prompt ``group`` (its identity), counted in flight until `release`.

        ``servers``: those up; ``loads``: the requests each holds (None: those acquired here and not released);
        ``earlier``: where ``request_id`` went before, if anywhere.
        """
        if not servers:
            raise RuntimeError("no server to place the request on")
        home = self._groups.get(group)
        if earlier is not None and earlier in servers:
            server = earlier
        elif home is not None and home.server in servers:
            server = home.server
        else:
            load = self.loads(servers) if loads is None else loads
            server = servers[self.policy.pick(servers, load, group)]
        if home is None:
            home = self._groups[group] = _GroupHome(server)
        elif home.server not in servers:  # its server left: the group moves, counting its requests still there
            home.server = server
        home.in_flight += 1
        self._requests.setdefault(request_id, []).append((group, server))
        self._in_flight[server] += 1
        return server

    def release(self, request_id: str) -> None:
        """One request of ``request_id`` is done (the oldest, when several are in flight under one id)."""
        placed = self._requests.get(request_id)
        if not placed:
            return
        group, server = placed.pop(0)
        if not placed:
            del self._requests[request_id]
        self._in_flight[server] -= 1
        if self._in_flight[server] <= 0:
            del self._in_flight[server]
        home = self._groups.get(group)
        if home is not None:
            home.in_flight -= 1
            if home.in_flight <= 0:
                del self._groups[group]

    def loads(self, servers: Sequence[str]) -> list[int]:
        """The requests acquired here and not released, on each of ``servers``."""
        return [self._in_flight[server] for server in servers]

    def clear(self) -> None:
        """Forget every group and request: the next requests are placed afresh (their releases then do nothing)."""
        self._groups.clear()
        self._requests.clear()
        self._in_flight.clear()
