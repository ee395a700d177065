"""Which endpoint a prompt group goes to: by the prompt (history-affine), by outstanding requests, or by predicted work.

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
from this client.  ``predicted-work`` remembers how long the responses
to each prompt were in earlier rollouts (`LengthHistory`, LRU-bounded) and places the
groups longest first, each onto the endpoint with the least predicted work (tokens)
assigned so far: the longest-processing-time rule, so that no endpoint is left alone with
the long groups at the end of a step.  Prompts never seen before count as the mean of the
known ones.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from samrollout_client.protocol.prompt_identity import prompt_id

Placement = Literal["affine", "least-outstanding", "predicted-work"]
PLACEMENTS: tuple[Placement, ...] = ("affine", "least-outstanding", "predicted-work")
DEFAULT_PLACEMENT: Placement = "affine"

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
        target = min(range(endpoints), key=lambda e: (totals[e], e))
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
    return min(ranking, key=lambda index: loads[index])


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
