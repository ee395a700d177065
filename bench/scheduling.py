"""Rollout makespan under fcfs and length-aware scheduling, SAM off and on, and client placement over 2 servers.

    python bench/scheduling.py --json bench/results/scheduling-cpu.json --plot bench/results/scheduling-cpu.png

The workload is rollout-shaped: G prompt groups x N responses (default 30 x 8, the Sky-T1
AIME groups of ``../shared/data/reasoning-traces/``) against ``--max-num-seqs`` engine
slots (default 16).  Each response's length is its real trace length scaled so that the
longest is ``--max-len`` tokens, so lengths are heavy-tailed and correlated within a
group as in real reasoning rollouts.  The server cannot read them: every request carries
the same ``max_tokens`` (above the longest), streams, and the benchmark hangs up when the
response reaches its length (the server sees an abort).  Requests are sent all at once,
the groups in a random order drawn per round (the same for every mode), as a trainer
sends a step of sampled prompts (``--order``: also the traces' order, or shortest group
first, the worst case for first-come-first-served).

Modes (servers started once, then every round runs every mode in a rotated order):

- ``fcfs``, ``length-aware``: one server with ``--rollout-scheduling`` fcfs / length-aware, SAM off;
- ``fcfs+sam``, ``length-aware+sam``: the same with SAM (the server's default speculation);
- ``vllm-priority``: fcfs in samrollout and vLLM's ``--scheduling-policy priority``, each request
  carrying ``priority`` = minus its group's mean length in earlier rounds (0 when unknown: round 1
  is fcfs): what a trainer can do with plain vLLM.  vLLM fixes a priority when the request is
  added (no probe can inform it) and, short of KV memory, preempts the lowest-priority running
  sequence; ``--kv-blocks`` makes memory short for every mode to measure that;
- ``2x-least-outstanding``, ``2x-predicted-work``: two length-aware + SAM servers with half the
  slots each, each pinned to its own half of the cores (`pinned_server`: as two machines
  would be, so that one server's idle time is not the other's gain); groups placed as the
  client does (`samrollout_client.placement`): alternately in the order they are sent (least
  outstanding, all groups start at once; the order is drawn anew each round, so a group does not
  keep its server by accident) or longest predicted first onto the least loaded, predicted from the
  client's history of earlier rounds;
- ``2x-affine``: the client's default placement (history-affine: rendezvous hashing of the prompt
  with bounded loads, the step's groups placed as one batch and weighed by their lengths in earlier
  rounds, `samrollout_client.placement.plan_affine`),
  on a pair of servers of its own, so that what their histories hold is its own doing.  Every
  paired mode's rounds record the pair's history hits (groups whose prompt had earlier responses
  in the server's history, ``samrollout_drafter_history_hit_groups_total`` over
  ``..._groups_total``): with ``--modes 2x-least-outstanding,2x-affine`` each pair is one mode's;
- ``2x-divided``: predicted-work placement plus divided rollout (the client's
  ``divide_after_tokens``, ``--divide-after-tokens``): a response whose current piece has that
  many tokens moves to the other server when the client's rule finds room for it there
  (`samrollout_client.rollouts.divided.has_room`), continuing from its prompt and generated token
  ids.  Each piece is streamed by the client's own `stream_piece` (rule, clean cuts,
  continuation requests, counts); only the loop over pieces is the benchmark's, which hangs
  up at the response's length (the client cannot: it does not know the lengths) and does
  not retry.  Moves are counted per round.

Every mode's server stays up for the whole run, so memory is checked: each server gets a KV
cache of ``--kv-cache-gib`` (0.4 GiB by default, set in bytes, so the same on any machine),
the run stops when the servers started leave less than `MEMORY_FLOOR_GIB` available, and
every round records its lowest available memory (a round below the floor is flagged: with
no swap the machine thrashes).

Round 1 is cold for length-aware (no history of these prompts); later rounds are warm,
as RL epochs revisit prompts.  Reported per mode: median makespan over rounds, each round's
makespan, tail time (from when fewer responses than slots were left to the end), mean queue
time (request sent to first token), and the lower bound (`lower_bound`).

The lower bound is the larger of the longest response alone and total work over slots,
measured on a server without SAM under fcfs.  Total work over slots is measured two ways:
extrapolated from the best of two single full batches of mean-length responses
(``total_over_slots_s`` = ``full_batch_s`` x responses / slots, before the rounds), and run
in full every round, interleaved with the modes (`packed_workload`: every response at the
mean length, so ``slots`` of them start and end together: the same tokens and prompts,
perfectly packed; ``packed_makespan_s``, median over rounds).  On these 2-core machines
neither is a strict bound (the packed run took 6-15% longer than the extrapolation on an
idle machine, and longer than the unpacked workload beside the other servers), so the
bound (`bound_of`) takes the lower of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from plotting import save, subplots

HERE = Path(__file__).resolve().parent
TRACES = HERE.parent.parent / "shared" / "data" / "reasoning-traces" / "skyt1-ckpt-aime24.jsonl.gz"
SINGLE = ("fcfs", "length-aware", "fcfs+sam", "length-aware+sam")
# vLLM's own priority scheduling, as a trainer could drive it: every request goes to the engine at once with
# a priority from the client's history (longest remembered group first; unknown: 0), SAM off.
PRIORITY = ("vllm-priority",)
PAIRED = ("2x-least-outstanding", "2x-predicted-work", "2x-divided", "2x-affine")
# Modes on a pair of their own: history-affine placement is measured by what each server's history holds, which
# another placement's rounds on the same pair would fill.
OWN_PAIR = ("2x-affine",)
# Every mode's server stays up for the whole run (rounds are interleaved).  With no swap, a machine whose
# available memory runs this low evicts code pages instead and crawls: a run of all modes with
# --gpu-memory-utilization 0.1 each left 0.5 GiB of 24 GiB and a worker spent 23 minutes on one step.  Below it
# the run stops (or is flagged).
MEMORY_FLOOR_GIB = 2.0


class MemoryWatch:
    """The machine's lowest available memory (psutil, GiB), sampled every ``period`` s in a thread."""

    def __init__(self, period: float = 0.5) -> None:
        self._period = period
        self._lowest = self.available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def available() -> float:
        """Available memory now, in GiB."""
        import psutil

        return float(psutil.virtual_memory().available) / 2**30

    def _sample(self) -> None:
        while not self._stop.wait(self._period):
            self._lowest = min(self._lowest, self.available())

    def lowest_since_reset(self) -> float:
        """The lowest sample since the last `reset` (or the start), now included."""
        return min(self._lowest, self.available())

    def reset(self) -> None:
        """Start a new low-water mark."""
        self._lowest = self.available()

    def stop(self) -> None:
        """End the sampling thread."""
        self._stop.set()
        self._thread.join()


def require_memory(watch: MemoryWatch, started: str) -> None:
    """Stop the run when the servers started so far (``started``) leave less than `MEMORY_FLOOR_GIB`."""
    left = watch.available()
    if left < MEMORY_FLOOR_GIB:
        raise SystemExit(f"after starting {started}, {left:.1f} GiB of memory is left (< {MEMORY_FLOOR_GIB} GiB): "
                         "the run would thrash. Run fewer --modes at a time (e.g. the four single-server modes, "
                         "then vllm-priority and the 2x modes) or lower --kv-cache-gib.")


@dataclass(frozen=True)
class Response:
    """One response of the workload: its group, prompt and enforced length."""

    group: int
    index: int
    prompt: str
    length: int


def load_workload(paths: list[Path], groups: int, group_size: int, max_len: int, prompt_chars: int) -> list[Response]:
    """``groups`` x ``group_size`` responses from trace files (groups with enough responses, file order).

    Sibling ``i``'s prompt ends in "Attempt i:": greedy siblings then differ, as the checkpoints'
    greedy answers in the Sky-T1 traces do, instead of repeating one another token for token.
    """
    by_prompt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        with gzip.open(path, "rt") as handle:
            for line in handle:
                record = json.loads(line)
                by_prompt[f"{path.name}:{record['prompt_id']}"].append(record)
    chosen = [records[:group_size] for records in by_prompt.values() if len(records) >= group_size][:groups]
    if not chosen:
        raise SystemExit(f"no group with {group_size} responses in {paths}")
    longest = max(len(r["response"]) for records in chosen for r in records)
    return [Response(g, i, f"{records[0]['prompt'][:prompt_chars]}\nAttempt {i + 1}:",
                     max(1, round(len(r["response"]) / longest * max_len)))
            for g, records in enumerate(chosen) for i, r in enumerate(records)]


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], length: int,
                      t0: float) -> dict[str, float]:
    """Stream one response and hang up at ``length`` tokens; returns its first-token and end times."""
    first = None
    got = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {await reply.aread()!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                got += len(choice.get("token_ids") or [])
            if got and first is None:
                first = time.monotonic() - t0
            if got >= length:
                break
    return {"first": first if first is not None else time.monotonic() - t0, "end": time.monotonic() - t0,
            "tokens": min(got, length)}


def request_body(response: Response, rollout: str, max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
    """The streamed completion request of one response (every request has the same ``max_tokens``)."""
    return {"model": "bench", "prompt": response.prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": temperature, "seed": seed + 1000 * response.group + response.index,
            "group_id": f"{rollout}.g{response.group}"}


async def run_rollout(urls: list[str], placement: list[int], workload: list[Response], rollout: str,
                      max_tokens: int, temperature: float, seed: int,
                      priorities: list[int] | None = None) -> dict[str, Any]:
    """Send every response at once (group order) to its group's server (with its group's vLLM ``priority``
    when given); the rollout's times."""
    limits = httpx.Limits(max_connections=len(workload) + 8, max_keepalive_connections=len(workload) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_stream_one(
            client, urls[placement[r.group]], {**request_body(r, rollout, max_tokens, temperature, seed),
                                               "rollout_id": rollout,
                                               **({"priority": priorities[r.group]} if priorities else {})},
            r.length, t0)) for r in workload]
        times = await asyncio.gather(*tasks)
    return {"makespan_s": max(t["end"] for t in times), "times": times}


async def _stream_divided(client: httpx.AsyncClient, endpoints: list[Any], home: Any, body: dict[str, Any],
                          length: int, t0: float, divide_after_tokens: int) -> dict[str, float]:
    """Stream one response as the client's divided rollout does, hanging up at ``length`` tokens.

    ``endpoints`` are the client's `Endpoint` objects, whose counts the client's rule reads
    (``home``'s outstanding count already holds this response).  Each piece is streamed by
    the client's own `stream_piece`; the loop over pieces is the client's without retries.
    """
    from samrollout_client.rollouts import divided

    def refused(reply: httpx.Response) -> None:
        raise RuntimeError(f"{reply.url}: {reply.status_code} {reply.text[:300]}")

    sample = divided.DividedSample(max_tokens=int(body["max_tokens"]), want_logprobs=False)
    base = {**body, "logprobs": 0, "return_token_ids": True}  # as the client sends: logprobs tell clean cuts
    endpoint = home
    while True:
        sample.start_piece(endpoint.url)
        target = await divided.stream_piece(client, endpoint, sample.body(base, body.get("seed")), sample,
                                            endpoints, divide_after_tokens, refused, hang_up_at=length)
        if target is None:
            end = time.monotonic() - t0
            first = sample.first_token_at - t0 if sample.first_token_at is not None else end
            return {"first": first, "end": end, "tokens": min(len(sample.token_ids), length),
                    "moves": sample.load_moves}
        sample.load_moves += 1
        endpoint = target


async def run_divided_rollout(urls: list[str], placement: list[int], workload: list[Response], rollout: str,
                              max_tokens: int, temperature: float, seed: int,
                              divide_after_tokens: int) -> dict[str, Any]:
    """`run_rollout` with divided rollout: every response streamed through `_stream_divided`."""
    from samrollout_client.endpoints import Endpoint

    endpoints = [Endpoint(url) for url in urls]
    for response in workload:  # all groups start at once: each endpoint holds its groups' responses
        endpoints[placement[response.group]].outstanding += 1
    limits = httpx.Limits(max_connections=2 * len(workload) + 8, max_keepalive_connections=2 * len(workload) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_stream_divided(
            client, endpoints, endpoints[placement[r.group]],
            {**request_body(r, rollout, max_tokens, temperature, seed), "rollout_id": rollout},
            r.length, t0, divide_after_tokens)) for r in workload]
        times = await asyncio.gather(*tasks)
    return {"makespan_s": max(t["end"] for t in times), "times": times,
            "moves": sum(int(t["moves"]) for t in times)}


def tail_seconds(times: list[dict[str, float]], slots: int) -> float:
    """Time from when fewer than ``slots`` responses were still unfinished to the end."""
    ends = sorted(t["end"] for t in times)
    return ends[-1] - ends[len(ends) - slots] if len(ends) >= slots else ends[-1]


async def lower_bound(url: str, workload: list[Response], slots: int, temperature: float) -> dict[str, float]:
    """The longest response alone, and an extrapolated total work over slots, measured on this server.

    - the longest response alone (its prompt, its length, nothing else running): one term of the bound;
    - an estimate of total work over slots: a full batch of ``slots`` responses of the mean
      length (prompts from the workload, prefill included), the best of two, times responses /
      slots.  The bound itself measures that term by running `packed_workload` every round
      (module docstring); the estimate is kept for comparison.

    Both are streamed and cut at their length like the workload itself, so they pay the same
    serving costs.
    """
    longest = max(workload, key=lambda r: r.length)
    mean_length = max(1, round(statistics.fmean(r.length for r in workload)))
    async with httpx.AsyncClient(timeout=600) as client:
        async def batch(items: list[Response]) -> float:
            t0 = time.monotonic()
            await asyncio.gather(*(_stream_one(client, url, request_body(r, f"bound-{i}", max_tokens, temperature, i),
                                               r.length, t0) for i, r in enumerate(items)))
            return time.monotonic() - t0
        max_tokens = longest.length + 16
        await batch([replace(longest, length=8)])  # warm-up
        alone = await batch([longest])
        full = min([await batch([replace(workload[(i * 7 + j) % len(workload)], length=mean_length)
                                 for j in range(slots)]) for i in range(2)])
    total = full * len(workload) / slots
    return {"longest_alone_s": alone, "full_batch_s": full, "total_over_slots_s": total}


def bound_of(rates: dict[str, Any]) -> float:
    """The lower bound: the longest response alone, or total work over slots if larger.

    Total work over slots is measured twice (`lower_bound`'s extrapolation from one full batch,
    and `packed_workload` run every round, median); neither is a strict bound on a noisy
    shared CPU (the packed run has come out slower than the unpacked workload), so the
    lower of the two is taken: the bound a schedule is held to is the harder one.
    """
    total = min(rates["total_over_slots_s"], rates["packed_makespan_s"])
    return float(max(rates["longest_alone_s"], total))


def packed_workload(workload: list[Response]) -> list[Response]:
    """The workload's total work with perfect packing: every response at the mean length, prompts unchanged.

    Sent in group order to a server with fcfs scheduling and ``slots`` slots, ``slots`` responses
    start together, end together and hand their slots to the next ``slots``: the same tokens
    (to rounding) in the fewest engine steps, so its makespan is total work over slots on that server.
    """
    mean_length = max(1, round(statistics.fmean(r.length for r in workload)))
    return [replace(r, length=mean_length) for r in workload]


def arrival_order(workload: list[Response], order: str, seed: int) -> list[Response]:
    """The workload with its groups in the order a step sends them.

    ``random``: a random order (one draw per round, the same for every mode); ``file``: the
    traces' order; ``short-first``: shortest group (mean length) first, the order that
    first-come-first-served handles worst.
    """
    groups = sorted({r.group for r in workload})
    if order == "random":
        random.Random(seed).shuffle(groups)
    elif order == "short-first":
        mean = {g: statistics.fmean(r.length for r in workload if r.group == g) for g in groups}
        groups.sort(key=lambda g: mean[g])
    rank = {g: i for i, g in enumerate(groups)}
    return sorted(workload, key=lambda r: (rank[r.group], r.index))


def preemptions(url: str) -> float:
    """The server's ``samrollout_preemptions_total`` (sequences preempted for KV memory so far)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("samrollout_preemptions_total "):
            return float(line.split()[1])
    return 0.0


def history_counts(url: str) -> tuple[float, float]:
    """The server's (groups, history-hit groups) counted so far (cross-epoch history, `/metrics`)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text

    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith(f"{name}_created"))

    return value("samrollout_drafter_history_groups_total"), value("samrollout_drafter_history_hit_groups_total")


def split_cores(parts: int) -> list[list[int]]:
    """This process's usable cores in ``parts`` equal, disjoint shares (every core used when they divide evenly)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < parts:
        raise SystemExit(f"{parts} pinned servers need {parts} cores, this machine lets us use {len(cores)}")
    share = len(cores) // parts
    return [cores[i * share:(i + 1) * share] for i in range(parts)]


def pinned_server(args: list[str], log: Path, cores: list[int]) -> Any:
    """`samrollout serve ARGS` with every process of it (API server, engine core, worker) on ``cores`` only.

    `taskset` pins the processes; ``VLLM_CPU_OMP_THREADS_BIND`` puts the worker's threads on the
    same cores (one per core), as on a machine of its own.
    """
    from samrollout.testing import start_command

    listed = ",".join(str(core) for core in cores)
    return start_command(lambda port: ["taskset", "-c", listed, sys.executable, "-m", "samrollout.cli", "serve",
                                       "--port", str(port), *args], log, {"VLLM_CPU_OMP_THREADS_BIND": listed})


def server_args(model: str, scheduling: str, sam: bool, slots: int, kv_cache_gib: float,
                kv_blocks: int | None = None, priority: bool = False) -> list[str]:
    """`samrollout serve` flags for one mode's server (``kv_cache_gib``: its KV cache, set in bytes so that it is
    the same on any machine; ``kv_blocks``: KV cache of that many 32-token blocks; ``priority``: vLLM's priority
    scheduling policy)."""
    args = ["--served-model-name", "bench", "--rollout-scheduling", scheduling, "--max-num-seqs", str(slots),
            "--max-model-len", "1024"]
    if model != "smollm2":
        args += ["--model", model]
    args += [] if sam else ["--no-speculation"]
    engine = ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    engine += (["--num-gpu-blocks-override", str(kv_blocks), "--block-size", "32"] if kv_blocks else []) + (
        ["--scheduling-policy", "priority"] if priority else [])
    return [*args, "--", *engine]


@dataclass(frozen=True)
class Plan:
    """What a run measures: the modes (in the order given), the workload and its number of groups."""

    modes: list[str]
    workload: list[Response]
    groups: int


@dataclass
class Measurements:
    """What `run` measured, for `report`."""

    rates: dict[str, Any]  # `lower_bound`'s terms
    bound_mode: str  # the server the bound ran on: the fcfs mode's, else one of its own ("bound")
    rounds: dict[str, list[dict[str, Any]]]  # per mode, one record per round
    packed_rounds: list[float] = field(default_factory=list)  # the packed workload's makespan per round


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the module docstring says what it measures)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, nargs="+", default=[TRACES])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256, help="the longest response, in tokens")
    parser.add_argument("--prompt-chars", type=int, default=120, help="each prompt is cut to this many characters")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine slots (split over 2 in the 2x modes)")
    parser.add_argument("--model", default="smollm2", help="smollm2 (built-in) or a model directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, the only requests SAM drafts for on vLLM's CPU backend")
    parser.add_argument("--order", choices=["random", "file", "short-first"], default="random",
                        help="the order groups are sent in (see arrival_order)")
    parser.add_argument("--modes", default=",".join(SINGLE + PRIORITY + PAIRED))
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV cache of this many 32-token blocks on every server (memory short: preemption)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.4,
                        help="each server's KV cache (default 0.4 GiB: 18K tokens of the small model in float32, "
                             "beside its 1.1 GiB of other worker memory; all modes' servers run at once, see "
                             "MEMORY_FLOOR_GIB)")
    parser.add_argument("--divide-after-tokens", type=int, default=64,
                        help="2x-divided: the client's divide_after_tokens (tokens a piece runs before it may move)")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "scheduling-cpu.json")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/samrollout-bench-scheduling"))
    return parser.parse_args(argv)


def plan(args: argparse.Namespace) -> Plan:
    """The modes to run (unknown ones refused) and the workload from the traces; prints the workload's size."""
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(SINGLE + PRIORITY + PAIRED)
    if unknown:
        raise SystemExit(f"unknown modes: {sorted(unknown)}")
    workload = load_workload(args.traces, args.groups, args.group_size, args.max_len, args.prompt_chars)
    groups = max(r.group for r in workload) + 1
    lengths = [r.length for r in workload]
    print(f"workload: {groups} groups, {len(workload)} responses, {sum(lengths)} tokens, longest {max(lengths)}, "
          f"median {statistics.median(lengths)}; {args.max_num_seqs} slots", flush=True)
    return Plan(modes, workload, groups)


def start_servers(args: argparse.Namespace, modes: list[str], memory: MemoryWatch,
                  servers: dict[str, list[Any]]) -> str:
    """Start every mode's server(s) into ``servers`` (filled as they start, so that the caller can stop them
    whatever happens), checking memory after each; returns the mode whose server the bound runs on.

    The bound runs without SAM under fcfs: on the fcfs mode's server, else on one of its own ("bound").
    """
    from samrollout.testing import start_server

    for mode in modes:
        if mode in SINGLE:
            scheduling, sam = mode.removesuffix("+sam"), mode.endswith("+sam")
            servers[mode] = [start_server(server_args(args.model, scheduling, sam, args.max_num_seqs,
                                                      args.kv_cache_gib, args.kv_blocks),
                                          args.logs / f"{mode}.log")]
        elif mode in PRIORITY:
            servers[mode] = [start_server(server_args(args.model, "fcfs", False, args.max_num_seqs,
                                                      args.kv_cache_gib, args.kv_blocks, priority=True),
                                          args.logs / f"{mode}.log")]
        else:
            continue
        print(f"started {mode} ({memory.available():.1f} GiB of memory left)", flush=True)
        require_memory(memory, mode)
    shared = [m for m in modes if m in PAIRED and m not in OWN_PAIR]
    for name, users in [("pair", shared), *[(m, [m]) for m in modes if m in OWN_PAIR]]:
        if not users:
            continue
        pair = [pinned_server(server_args(args.model, "length-aware", True, args.max_num_seqs // 2,
                                          args.kv_cache_gib, args.kv_blocks), args.logs / f"{name}-{i}.log", cores)
                for i, cores in enumerate(split_cores(2))]
        for mode in users:
            servers[mode] = pair
        print(f"started the 2-server pair of {', '.join(users)} ({memory.available():.1f} GiB of memory left)",
              flush=True)
        require_memory(memory, f"the 2-server pair of {', '.join(users)}")
    bound_mode = "fcfs" if "fcfs" in servers else "bound"
    if bound_mode == "bound":
        servers[bound_mode] = [start_server(server_args(args.model, "fcfs", False, args.max_num_seqs,
                                                        args.kv_cache_gib), args.logs / "bound.log")]
        require_memory(memory, "the bound's server")
    return bound_mode


def placement_of(mode: str, history: Any, groups: int, group_size: int, step: list[Response] | None = None,
                 urls: list[str] | None = None) -> list[int]:
    """Each group's server (index into the mode's pair) as the client's placement policy places it under ``mode``
    (`samrollout_client.placement.place_groups`: all groups start at once, nothing else in flight).

    ``history`` is the client's `LengthHistory` of earlier rounds (affine and predicted-work weigh the groups by
    it); ``step`` (the round's arrival order) and ``urls`` are what affine placement hashes and places in, and
    the order least-outstanding meets the groups in.
    """
    from samrollout_client.placement import GroupDemand, place_groups, placement_policy
    from samrollout_client.protocol.prompt_identity import prompt_id

    policy = {"2x-affine": "affine", "2x-predicted-work": "predicted-work", "2x-divided": "predicted-work",
              "2x-least-outstanding": "least-outstanding"}.get(mode)
    if policy is None:
        return [0] * groups
    assert policy != "affine" or (step is not None and urls is not None)
    first = {r.group: r.prompt for r in reversed(step or [])}  # a group is known by its first sibling's prompt
    order = list(dict.fromkeys(r.group for r in step)) if step is not None else list(range(groups))
    if policy == "predicted-work":  # longest first, equal ones by group number
        order = list(range(groups))
    demands = [GroupDemand(prompt_id(first[g]) if g in first else str(g), group_size, history.predict(str(g)))
               for g in order]
    endpoints = urls if urls is not None else ["server-0", "server-1"]
    chosen = place_groups(placement_policy(policy), demands, endpoints, [0] * len(endpoints))
    by_group = dict(zip(order, chosen, strict=True))
    return [by_group[g] for g in range(groups)]


def run_mode_round(args: argparse.Namespace, planned: Plan, mode: str, urls: list[str], step: list[Response],
                   round_index: int, history: Any, memory: MemoryWatch) -> dict[str, Any]:
    """One round of one mode: ``step`` (the round's arrival order) rolled out on its servers; the round's record,
    printed."""
    placement = placement_of(mode, history, planned.groups, args.group_size, step, urls)
    rollout = f"r{round_index}-{mode}"
    preempted_before = sum(preemptions(url) for url in urls)
    hits_before = [history_counts(url) for url in urls]
    memory.reset()
    if mode == "2x-divided":
        result = asyncio.run(run_divided_rollout(urls, placement, step, rollout, args.max_len + 16,
                                                 args.temperature, round_index, args.divide_after_tokens))
    else:
        priorities = ([-round(history.predict(str(g)) or 0) for g in range(planned.groups)]
                      if mode in PRIORITY else None)
        result = asyncio.run(run_rollout(urls, placement, step, rollout, args.max_len + 16,
                                         args.temperature, round_index, priorities))
    times = result["times"]
    slots = args.max_num_seqs
    record = {"round": round_index, "makespan_s": result["makespan_s"],
              "tail_s": tail_seconds(times, slots),
              "mean_queue_s": statistics.fmean(t["first"] for t in times),
              "p90_queue_s": sorted(t["first"] for t in times)[int(0.9 * len(times))]}
    record["preemptions"] = sum(preemptions(url) for url in urls) - preempted_before
    counted = [tuple(a - b for a, b in zip(history_counts(url), before, strict=True))
               for url, before in zip(urls, hits_before, strict=True)]
    record["history_groups"] = sum(c[0] for c in counted)
    record["history_hit_groups"] = sum(c[1] for c in counted)
    record["lowest_available_memory_gib"] = round(memory.lowest_since_reset(), 2)
    if "moves" in result:
        record["moves"] = result["moves"]
    moves = f"  moves {record['moves']}" if "moves" in record else ""
    low = record["lowest_available_memory_gib"]
    short = "  MEMORY SHORT: this round is not a fair measurement" if low < MEMORY_FLOOR_GIB else ""
    hits = f"  history hits {record['history_hit_groups']:.0f}/{record['history_groups']:.0f}"
    print(f"round {round_index} {mode:22s} makespan {record['makespan_s']:7.2f} s  tail "
          f"{record['tail_s']:6.2f} s  mean queue {record['mean_queue_s']:6.2f} s  preemptions "
          f"{record['preemptions']:.0f}{moves}{hits}  memory left >= {low:.1f} GiB{short}", flush=True)
    return record


def run(args: argparse.Namespace, planned: Plan) -> Measurements:
    """Start the servers and measure the bound, then run the packed workload and every mode in rotated order each
    round; every server is stopped at the end (or on an error)."""
    from samrollout_client.placement import LengthHistory

    servers: dict[str, list[Any]] = {}
    memory = MemoryWatch()
    try:
        bound_mode = start_servers(args, planned.modes, memory, servers)
        bound_url = servers[bound_mode][0].url
        rates: dict[str, Any] = asyncio.run(lower_bound(bound_url, planned.workload, args.max_num_seqs,
                                                        args.temperature))
        print(f"longest alone {rates['longest_alone_s']:.1f} s; total work over slots extrapolated from one full "
              f"batch {rates['total_over_slots_s']:.1f} s (measured each round: packed)", flush=True)
        packed = arrival_order(packed_workload(planned.workload), "file", 0)
        measured = Measurements(rates, bound_mode, {m: [] for m in planned.modes})

        history = LengthHistory()
        cycle = ["packed", *planned.modes]
        for round_index in range(args.rounds):
            order = cycle[round_index % len(cycle):] + cycle[:round_index % len(cycle)]
            step = arrival_order(planned.workload, args.order, round_index)
            for mode in order:
                if mode == "packed":
                    result = asyncio.run(run_rollout([bound_url], [0] * planned.groups, packed,
                                                     f"r{round_index}-packed", args.max_len + 16, args.temperature,
                                                     round_index))
                    measured.packed_rounds.append(result["makespan_s"])
                    print(f"round {round_index} {'packed (bound)':22s} makespan {result['makespan_s']:7.2f} s",
                          flush=True)
                    continue
                urls = [s.url for s in servers[mode]]
                measured.rounds[mode].append(run_mode_round(args, planned, mode, urls, step, round_index, history,
                                                            memory))
                for g in range(planned.groups):  # the client learns each group's lengths, as RolloutClient does
                    history.record(str(g), [r.length for r in planned.workload if r.group == g])
    finally:
        memory.stop()
        for pair_or_one in {id(v): v for v in servers.values()}.values():
            for server in pair_or_one:
                server.stop()
    return measured


def report(args: argparse.Namespace, planned: Plan, measured: Measurements) -> None:
    """The bound and every mode's medians: printed as a table, written as JSON (and plotted with ``--plot``)."""
    rates, packed_rounds, workload = measured.rates, measured.packed_rounds, planned.workload
    rates["packed_rounds_s"] = packed_rounds
    rates["packed_makespan_s"] = statistics.median(packed_rounds)
    rates["bound_s"] = bound = bound_of(rates)
    rates["bound_server"] = measured.bound_mode
    summary = {mode: {"makespan_s": statistics.median(r["makespan_s"] for r in rs),
                      "cold_makespan_s": rs[0]["makespan_s"],
                      "warm_makespan_s": statistics.median(r["makespan_s"] for r in rs[1:]) if len(rs) > 1 else None,
                      "tail_s": statistics.median(r["tail_s"] for r in rs),
                      "mean_queue_s": statistics.median(r["mean_queue_s"] for r in rs),
                      "preemptions": sum(r["preemptions"] for r in rs),
                      "lowest_available_memory_gib": min(r["lowest_available_memory_gib"] for r in rs),
                      "warm_history_hit_rate": (sum(r["history_hit_groups"] for r in rs[1:])
                                                / max(1, sum(r["history_groups"] for r in rs[1:]))),
                      "rounds": rs} for mode, rs in measured.rounds.items()}
    print(f"\nlower bound {bound:.2f} s: the larger of the longest response alone ({rates['longest_alone_s']:.2f} s) "
          f"and the lower of the packed workload ({rates['packed_makespan_s']:.2f} s, median of {packed_rounds}) "
          f"and its extrapolation from one full batch ({rates['total_over_slots_s']:.2f} s)")
    print(f"{'mode':22s} {'makespan s':>10s} {'cold':>7s} {'warm':>7s} {'tail s':>7s} {'queue s':>8s} "
          f"{'/fcfs':>6s} {'/bound':>7s} {'preempted':>9s} {'warm hits':>9s}")
    base = summary.get("fcfs", {}).get("makespan_s")
    for mode, s in summary.items():
        warm = f"{s['warm_makespan_s']:7.2f}" if s["warm_makespan_s"] is not None else "      -"
        ratio = f"{s['makespan_s'] / base:6.2f}" if base else "     -"
        print(f"{mode:22s} {s['makespan_s']:10.2f} {s['cold_makespan_s']:7.2f} {warm} {s['tail_s']:7.2f} "
              f"{s['mean_queue_s']:8.2f} {ratio} {s['makespan_s'] / bound:7.2f} {s['preemptions']:9.0f} "
              f"{s['warm_history_hit_rate']:9.0%}")
    lengths = [r.length for r in workload]
    out = {"command": " ".join(sys.argv), "workload": {
        "traces": [str(p.name) for p in args.traces], "groups": planned.groups, "group_size": args.group_size,
        "responses": len(workload), "tokens": sum(lengths), "longest": max(lengths),
        "median": statistics.median(lengths), "max_num_seqs": args.max_num_seqs, "model": args.model,
        "order": args.order, "temperature": args.temperature, "divide_after_tokens": args.divide_after_tokens,
        "kv_blocks": args.kv_blocks, "server_kv_cache_gib": args.kv_cache_gib},
        "lower_bound": rates, "lower_bound_s": bound, "modes": summary}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    if args.plot is not None:
        plot(summary, rates, args.plot)


def main() -> None:
    """Start the servers, run every mode in rotated order each round, print the table, write JSON and a plot."""
    args = parse_args()
    planned = plan(args)
    report(args, planned, run(args, planned))


def plot(summary: dict[str, dict[str, Any]], rates: dict[str, Any], path: Path) -> None:
    """Bars: median makespan per mode (each round as a dot); the lower bound and the packed workload's median as
    lines (the label also gives the one-batch extrapolation)."""
    modes = list(summary)
    fig, ax = subplots(figsize=(9, 4.5))
    ax.bar(range(len(modes)), [summary[m]["makespan_s"] for m in modes], color="#4c72b0", alpha=0.8,
           label="median makespan")
    ax.bar(range(len(modes)), [summary[m]["tail_s"] for m in modes], color="#dd8452", alpha=0.8, width=0.5,
           label="tail (fewer running than slots)")
    for i, m in enumerate(modes):
        ax.scatter([i] * len(summary[m]["rounds"]), [r["makespan_s"] for r in summary[m]["rounds"]],
                   color="black", s=12, zorder=3)
    bound = rates["bound_s"]
    ax.axhline(bound, color="#55a868", linestyle="--", label=f"lower bound (no SAM) {bound:.1f} s")
    ax.axhline(rates["packed_makespan_s"], color="gray", linestyle=":",
               label=f"packed workload {rates['packed_makespan_s']:.1f} s, one batch extrapolated "
                     f"{rates['total_over_slots_s']:.1f} s (bound: the lower)")
    ax.set_xticks(range(len(modes)), modes, rotation=20, ha="right")
    ax.set_ylabel("seconds")
    ax.set_title("Rollout makespan by scheduling (dots: rounds)")
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
