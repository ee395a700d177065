"""Synchronous against asynchronous RL rollouts: a GRPO-shaped loop with a simulated trainer, three ways.

    python bench/async_rollout.py --json bench/results/async-rollout-cpu.json --plot bench/results/async-rollout-cpu.png

Starts `samrollout serve` with the built-in SmolLM2-135M-Instruct and runs the same loop in each
mode, one after the other on that server: take a batch of ``--groups`` GRPO groups of
``--group-size`` sampled responses (temperature 1, ``--max-tokens``), "train" (a sleep of
``--train-s``), then load new weights as a new version (``update_weights`` from the
checkpoint's directory: the same tensors under a new name each step, as
bench/weight_push.py does; the load is what a real update costs, the values do not matter
to throughput).  The prompts are chat-formatted questions whose natural answers range from
a number to a long essay (`questions`), so response lengths are mixed and each step has a
long tail.

- ``sync-wait``: each step sends its groups and waits for every response
  (`AsyncRolloutClient.generate`); the update (``in_flight="wait"``) finds nothing running.
- ``sync-abort``: each step sends ``--oversample`` more groups than it needs
  (``ceil(groups * (1 + oversample))``, each group a `generate` call of its own), takes the
  first ``--groups`` to complete, and trains while the rest run on; the update
  (``in_flight="abort"``) ends them.  Every token not in the batch is discarded: the aborted
  responses' and those of the groups that finished but were not taken (the next step is
  on-policy, from the new weights).
- ``async-continue``: a partial rollout (`AsyncRolloutClient.partial_rollout`, up to
  ``--max-concurrent-groups`` groups generating, default two batches) hands over the first
  ``--groups`` groups to complete; the unfinished ones keep generating through the trainer's
  sleep and the update (``in_flight="continue"``) goes on under the new weights, their KV
  computed again.  ``--max-staleness`` (default: no bound) restarts samples past it (their
  tokens count as discarded).
- ``async-continue-keep-kv``: the same with ``in_flight="continue-keep-kv"``: the samples
  in flight keep their KV cache across the update (nothing prefilled again).

For the two async modes each update's *recovery* is measured too: the seconds from the
update's return until the server's token rate (over the last ``RATE_WINDOW_S``) is back to
``RECOVERED`` of the rate in the second before the update (the trainer's last second of
sleep, the same requests running): how long the requests in flight take to be back at full
speed.

With ``--servers N`` it starts N servers, each engine bound to a core of its own (the client
places groups over them with its default placement), and with ``--rounds R`` it runs the modes
R times interleaved (round 1: every mode, round 2: every mode, ...), the machine's drift shared
alike; the table gives each mode's median.  ``--record DIR`` writes every group each mode and
round ran (prompt and response token ids, the server it ran on, finish reasons) as
``DIR/<mode>-<round>.jsonl.gz``, in the order the client started them, for
``bench/simulator_rl_calibration.py`` to simulate; so that the simulation knows every group
the loop had in flight, ``async-continue`` then lets the groups still held run to their end
(after its wall time is taken; it starts no new prompt).

Every mode takes the same prompts in the same order, with the same seeds (sample i of a group:
``--seed + i``).  The server runs with its default length-aware scheduling but remembers no
prompt's response lengths (``--scheduling-history 0``), so no mode is scheduled with what an
earlier one taught it.

The trainer's sleep is, by default, the median rollout time of ``--calibration-steps`` (1)
sync steps run first (the time from sending a step's groups to its last response), so
training takes as long as generating, the case asynchronous RL is made for.  Reported per
mode: samples per second (samples handed to the trainer over the wall time of the loop,
updates and sleeps included), discarded tokens, step and update times, the staleness of the
samples returned (how many versions their oldest token lags behind the newest), and the
server's own counters (continued requests, tokens prefilled again, update pause time).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from harness import host, write_json
from samrollout_client.rollout_rules import LOOP_MODES, in_flight_of

HERE = Path(__file__).resolve().parent
MODES = LOOP_MODES
# An async mode with its own max_staleness, e.g. async-continue-s2 or async-continue-keep-kv-s2.
BOUNDED = re.compile(r"^(async-continue(?:-keep-kv)?)-s(\d+)$")


def mode_runner(mode: str, args: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """The runner's name for ``mode`` and the arguments it runs with: the update's ``in_flight`` (``-keep-kv``:
    ``continue-keep-kv``) and for ``...-sK`` max_staleness K."""
    bound = BOUNDED.match(mode)
    base = bound.group(1) if bound else mode
    kv = "keep" if base.endswith("-keep-kv") else "recompute"
    changes: dict[str, Any] = {"in_flight": in_flight_of("async-continue", kv)}
    if bound:
        changes["max_staleness"] = int(bound.group(2))
    runner = "async-continue" if base.startswith("async-continue") else base
    return runner, argparse.Namespace(**{**vars(args), **changes})
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
TOPICS = ("the ocean", "volcanoes", "the Roman empire", "honey bees", "the moon", "trains", "chess", "rain forests",
          "electricity", "bread", "glaciers", "the internet", "owls", "music", "mountains", "deserts")
RATE_WINDOW_S = 0.5   # the token rate after an update, over this trailing window
RECOVERED = 0.8       # ... back to this fraction of the rate before it: the requests in flight are at full speed
RECOVERY_LIMIT_S = 30.0
SERVER_COUNTERS = {"continued_requests": "samrollout_continued_requests_total",
                   "recomputed_tokens": "samrollout_recomputed_tokens_total",
                   "preemptions": "samrollout_preemptions_total",
                   "generated_tokens": "samrollout_generated_tokens_total"}


def questions(seed: int) -> Iterator[str]:
    """An endless stream of chat prompts, most with short answers, some with long ones.

    Probed on the built-in model (temperature 1, 192 tokens at most): a number or a word
    mostly takes 10-50 tokens (now and then a sample rambles to the limit), two sentences
    25-50, three tips 90-192, an essay or a long story reaches the limit.  Weighted 5 : 3 : 2 :
    2, so a step of 8 groups has a long tail: a group or two whose every sample runs to the
    limit while most finish early.
    """
    rng = random.Random(seed)
    while True:
        topic = rng.choice(TOPICS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = rng.choices(["short", "sentences", "tips", "long"], weights=[5, 3, 2, 2])[0]
        question = {
            "short": rng.choice([f"What is {a} + {b}? Reply with the number only.",
                                 f"Name one animal that lives near {topic}. One word."]),
            "sentences": f"In two sentences, what is interesting about {topic}?",
            "tips": f"Give three short tips for learning about {topic}.",
            "long": rng.choice([f"Write a long, detailed essay about {topic}, with many examples.",
                                f"Tell me a long story about a child who discovers {topic}."]),
        }[kind]
        yield CHAT.format(question=question)


def server_counters(url: str) -> dict[str, float]:
    """The server's counters of `SERVER_COUNTERS` and the update pause histogram (sum and count per mode)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    values: dict[str, float] = {}
    for key, name in SERVER_COUNTERS.items():
        values[key] = sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    for part in ("sum", "count"):
        for match in re.finditer(rf'^samrollout_weight_update_pause_seconds_{part}{{in_flight="([\w-]+)"}} (\S+)$',
                                 text, re.M):
            values[f"pause_{part}_{match.group(1)}"] = float(match.group(2))
    return values


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server counted during one mode."""
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in sorted(set(before) | set(after))}


async def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the server has no request in flight (what one mode left behind must not slow the next)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            status = (await http.get(f"{url}/admin/status", params={"drafter": "false"}, timeout=10.0)).json()
            if not status.get("in_flight_requests"):
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server still has requests in flight after {timeout_s} s")


def tokens(groups: list[Any]) -> int:
    """Generated tokens of these groups' samples."""
    return sum(len(s.token_ids) for g in groups for s in g.samples)


def staleness_counts(groups: list[Any], history: list[str]) -> Counter[int]:
    """How many returned samples have each staleness (versions their oldest token lags behind the newest)."""
    return Counter(s.staleness(history) for g in groups for s in g.samples)


def generated_tokens(urls: list[str]) -> float:
    """Tokens the servers have generated so far (their ``samrollout_generated_tokens_total``)."""
    return sum(server_counters(url)["generated_tokens"] for url in urls)


async def token_rate(urls: list[str], seconds: float) -> float:
    """The servers' generated tokens per second over the next ``seconds``."""
    start, began = await asyncio.to_thread(generated_tokens, urls), time.perf_counter()
    await asyncio.sleep(seconds)
    return (await asyncio.to_thread(generated_tokens, urls) - start) / (time.perf_counter() - began)


async def recovery_s(urls: list[str], rate_before: float) -> float:
    """Seconds from now until the token rate over the last `RATE_WINDOW_S` is back to `RECOVERED` x ``rate_before``
    (0 when nothing was generating; `RECOVERY_LIMIT_S` if it never is)."""
    if rate_before <= 0:
        return 0.0
    began = time.perf_counter()
    samples = [(began, await asyncio.to_thread(generated_tokens, urls))]
    while (now := time.perf_counter()) - began < RECOVERY_LIMIT_S:
        await asyncio.sleep(0.05)
        now, count = time.perf_counter(), await asyncio.to_thread(generated_tokens, urls)
        samples.append((now, count))
        window = [(t, c) for t, c in samples if t >= now - RATE_WINDOW_S]
        if now - began >= RATE_WINDOW_S and len(window) > 1:
            (t0, c0), (t1, c1) = window[0], window[-1]
            if t1 > t0 and (c1 - c0) / (t1 - t0) >= RECOVERED * rate_before:
                return t0 - began  # the window that reached full speed began here
    return RECOVERY_LIMIT_S


class StoppablePrompts:
    """A prompt iterator that can be told to end (the async mode's drain for the recording)."""

    def __init__(self, prompts: Iterator[str]) -> None:
        self.prompts, self.stopped = prompts, False

    def __iter__(self) -> StoppablePrompts:
        return self

    def __next__(self) -> str:
        if self.stopped:
            raise StopIteration
        return next(self.prompts)

    def stop(self) -> None:
        """No prompt after this one."""
        self.stopped = True


def write_recording(path: Path, groups_run: list[tuple[int, bool, Any]], urls: list[str]) -> None:
    """Every group a mode ran, in the order the client started them: step, whether the trainer took it, the
    server it ran on, prompt and response token ids, finish reasons (a JSONL line each, gzipped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for step, taken, group in sorted(groups_run, key=lambda row: (row[0], row[2].index)):
            samples = group.samples
            handle.write(json.dumps({
                "step": step, "index": group.index, "taken": taken,
                "server": urls.index(samples[0].endpoint) if samples and samples[0].endpoint in urls else None,
                "prompt_ids": next((s.prompt_token_ids for s in samples if s.prompt_token_ids), None),
                "response_ids": [s.token_ids for s in samples],
                "finish_reasons": [s.finish_reason for s in samples]}) + "\n")


def record_step(record: dict[str, Any], groups: list[Any], rollout_s: float, began: float, updated: float,
                done: float) -> None:
    """Add one trainer step to a mode's record: its rollout, update and step times, samples and useful tokens."""
    record["rollout_s"].append(rollout_s)
    record["update_s"].append(done - updated)
    record["step_s"].append(done - began)
    record["samples"] += sum(len(g.samples) for g in groups)
    record["useful_tokens"] += tokens(groups)


async def sync_step(client: Any, prompts: Iterator[str], args: argparse.Namespace, sampling: Any,
                    rollout_id: str) -> tuple[list[Any], float]:
    """One sync step's rollout: every group, every response; its groups and its seconds."""
    start = time.perf_counter()
    groups = await client.generate(list(itertools.islice(prompts, args.groups)), n=args.group_size,
                                   sampling=sampling, rollout_id=rollout_id)
    return groups, time.perf_counter() - start


async def run_sync_wait(client: Any, prompts: Iterator[str], args: argparse.Namespace, sampling: Any,
                        weights: str) -> dict[str, Any]:
    """``sync-wait``: generate a batch, train, update with ``wait``."""
    record: dict[str, Any] = {"step_s": [], "rollout_s": [], "update_s": [], "samples": 0, "useful_tokens": 0,
                              "discarded_tokens": 0, "groups_run": []}
    staleness: Counter[int] = Counter()
    start = time.perf_counter()
    for step in range(args.steps):
        began = time.perf_counter()
        groups, rollout_s = await sync_step(client, prompts, args, sampling, f"sync-wait-{step}")
        record["groups_run"] += [(step, True, g) for g in groups]
        staleness += staleness_counts(groups, client.weight_versions)
        await asyncio.sleep(args.train_s)
        updated = time.perf_counter()
        await client.update_weights(weights, f"sync-wait-{step + 1}", in_flight="wait")
        done = time.perf_counter()
        record_step(record, groups, rollout_s, began, updated, done)
        print(f"  sync-wait step {step + 1}/{args.steps}: rollout {rollout_s:.1f} s, step {done - began:.1f} s",
              file=sys.stderr, flush=True)
    record["wall_s"] = time.perf_counter() - start
    record["staleness"] = dict(sorted(staleness.items()))
    return record


async def run_sync_abort(client: Any, prompts: Iterator[str], args: argparse.Namespace, sampling: Any,
                         weights: str) -> dict[str, Any]:
    """``sync-abort``: over-sample, take the first groups to finish, train, update with ``abort``."""
    record: dict[str, Any] = {"step_s": [], "rollout_s": [], "update_s": [], "samples": 0, "useful_tokens": 0,
                              "discarded_tokens": 0, "aborted_samples": 0, "unused_complete_groups": 0,
                              "groups_run": []}
    staleness: Counter[int] = Counter()
    sent = math.ceil(args.groups * (1 + args.oversample))
    start = time.perf_counter()
    for step in range(args.steps):
        began = time.perf_counter()
        rollout_id = f"sync-abort-{step}"
        tasks = [asyncio.create_task(client.generate([prompt], n=args.group_size, sampling=sampling,
                                                     rollout_id=rollout_id))
                 for prompt in itertools.islice(prompts, sent)]
        pending, finished = set(tasks), list[asyncio.Task[Any]]()
        while len(finished) < args.groups:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finished += sorted(done, key=tasks.index)
        batch = [group for task in finished[:args.groups] for group in task.result()]
        rollout_s = time.perf_counter() - began
        staleness += staleness_counts(batch, client.weight_versions)
        await asyncio.sleep(args.train_s)
        updated = time.perf_counter()
        await client.update_weights(weights, f"sync-abort-{step + 1}", in_flight="abort")
        await client.abort(rollout_id)  # any left waiting for an engine slot would otherwise start on the new weights
        done_at = time.perf_counter()
        rest = [group for task in [*finished[args.groups:], *pending] for group in await task]
        taken = set(finished[:args.groups])
        record["groups_run"] += [(step, task in taken, group) for task in tasks for group in await task]
        record["discarded_tokens"] += tokens(rest)
        record["aborted_samples"] += sum(s.finish_reason == "abort" for g in rest for s in g.samples)
        record["unused_complete_groups"] += sum(all(s.finish_reason != "abort" for s in g.samples) for g in rest)
        record_step(record, batch, rollout_s, began, updated, done_at)
        print(f"  sync-abort step {step + 1}/{args.steps}: rollout {rollout_s:.1f} s, step {done_at - began:.1f} s, "
              f"discarded {tokens(rest)} tokens", file=sys.stderr, flush=True)
    record["wall_s"] = time.perf_counter() - start
    record["staleness"] = dict(sorted(staleness.items()))
    record["groups_sent_per_step"] = sent
    return record


async def run_async_continue(client: Any, prompts: Iterator[str], args: argparse.Namespace, sampling: Any,
                             weights: str) -> dict[str, Any]:
    """``async-continue`` (and ``-keep-kv``): a partial rollout; train while the unfinished samples run on; update with
    ``args.in_flight``; each update's recovery (`recovery_s`)."""
    record: dict[str, Any] = {"step_s": [], "rollout_s": [], "update_s": [], "samples": 0, "useful_tokens": 0,
                              "carried_over": [], "groups_run": [], "rate_before_update": []}
    recoveries: list[asyncio.Task[float]] = []  # measured beside the loop, which goes on meanwhile
    staleness: Counter[int] = Counter()
    stream = StoppablePrompts(prompts)
    start = time.perf_counter()
    async with client.partial_rollout(stream, args.group_size, batch_groups=args.groups, sampling=sampling,
                                      max_staleness=args.max_staleness,
                                      max_concurrent_groups=args.max_concurrent_groups,
                                      rollout_id="async-continue") as rollout:
        for step in range(args.steps):
            began = time.perf_counter()
            batch = await rollout.next_batch()
            rollout_s = time.perf_counter() - began
            record["groups_run"] += [(step, True, g) for g in batch]
            record["carried_over"].append(rollout.running)
            staleness += staleness_counts(batch, rollout.versions)
            await asyncio.sleep(max(0.0, args.train_s - 1.0))
            rate = await token_rate(args.urls, min(1.0, args.train_s))  # the trainer's last second
            updated = time.perf_counter()
            await client.update_weights(weights, f"async-continue-{step + 1}", in_flight=args.in_flight)
            done = time.perf_counter()
            record["rate_before_update"].append(rate)
            recoveries.append(asyncio.create_task(recovery_s(args.urls, rate)))
            record_step(record, batch, rollout_s, began, updated, done)
            print(f"  async-continue step {step + 1}/{args.steps}: waited {rollout_s:.1f} s for the batch, step "
                  f"{done - began:.1f} s, {rollout.running} samples carried on", file=sys.stderr, flush=True)
        record["wall_s"] = time.perf_counter() - start
        stats = rollout.stats.model_copy()
        record["in_flight_at_end"] = rollout.running
        if args.record:  # let what is held run to its end (no new prompt), so the recording has every group
            stream.stop()
            while rest := await rollout.next_batch():
                record["groups_run"] += [(args.steps, False, g) for g in rest]
    record["recovery_s"] = list(await asyncio.gather(*recoveries))
    record["discarded_tokens"] = stats.discarded_tokens
    record["partial_rollout_stats"] = stats.model_dump()
    record["staleness"] = dict(sorted(staleness.items()))
    return record


RUNNERS = {"sync-wait": run_sync_wait, "sync-abort": run_sync_abort, "async-continue": run_async_continue}


async def run(args: argparse.Namespace, urls: list[str], weights: str) -> dict[str, Any]:
    """Calibrate the trainer's sleep, then run every mode ``--rounds`` times, interleaved; the JSON's body."""
    from samrollout_client import AsyncRolloutClient, Sampling

    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    result: dict[str, Any] = {"modes": {}}
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    async with AsyncRolloutClient(urls, model="bench", max_in_flight=args.max_in_flight,
                                  request_timeout_s=1800.0) as client:
        await client.generate([next(questions(args.seed + 999 + i)) for i in range(len(urls))], n=2,
                              sampling=sampling, rollout_id="warm-up")
        calibration = []
        prompts = questions(args.seed + 1)
        for step in range(args.calibration_steps):
            groups, seconds = await sync_step(client, prompts, args, sampling, f"calibration-{step}")
            lengths = sorted(len(s.token_ids) for g in groups for s in g.samples)
            calibration.append({"rollout_s": seconds, "tokens": sum(lengths), "median_tokens":
                                statistics.median(lengths), "longest_tokens": lengths[-1],
                                "at_max_tokens": sum(length >= args.max_tokens for length in lengths)})
            print(f"calibration step {step + 1}: {seconds:.1f} s, {sum(lengths)} tokens, median "
                  f"{statistics.median(lengths):.0f}, longest {lengths[-1]}", file=sys.stderr, flush=True)
        if args.train_s is None:
            args.train_s = statistics.median(c["rollout_s"] for c in calibration) if calibration else 0.0
        result["calibration"] = calibration
        result["train_s"] = args.train_s
        print(f"trainer step: {args.train_s:.1f} s", file=sys.stderr, flush=True)
        for round_index in range(args.rounds):
            for mode in args.modes:
                rounds[mode].append(await run_mode(client, mode, round_index, urls, args, sampling, weights))
    result["modes"] = {mode: summarize_rounds(records) for mode, records in rounds.items()}
    return result


async def run_mode(client: Any, mode: str, round_index: int, urls: list[str], args: argparse.Namespace,
                   sampling: Any, weights: str) -> dict[str, Any]:
    """One round of one mode, the servers idle before and after; its record (and its recording, if asked)."""
    for url in urls:
        await wait_idle(url)
    before = [server_counters(url) for url in urls]
    print(f"{mode} (round {round_index + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
    runner, mode_args = mode_runner(mode, args)
    mode_args.urls = urls
    record = await RUNNERS[runner](client, questions(args.seed), mode_args, sampling, weights)
    for url in urls:
        await wait_idle(url)
    deltas = [counters_delta(b, server_counters(url)) for b, url in zip(before, urls, strict=True)]
    record["server"] = {key: sum(d.get(key, 0.0) for d in deltas) for key in sorted({k for d in deltas for k in d})}
    record["samples_per_s"] = record["samples"] / record["wall_s"]
    record["useful_tokens_per_s"] = record["useful_tokens"] / record["wall_s"]
    record["steps"] = args.steps
    groups_run = record.pop("groups_run")
    if args.record:
        write_recording(args.record / f"{mode}-{round_index}.jsonl.gz", groups_run, urls)
    return record


def summarize_rounds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode over its rounds: the median round's record, with the median samples/s and every round's."""
    rates = [r["samples_per_s"] for r in records]
    middle = sorted(records, key=lambda r: r["samples_per_s"])[(len(records) - 1) // 2]
    return {**middle, "samples_per_s": statistics.median(rates), "samples_per_s_rounds": rates,
            "median_round": records.index(middle), "rounds": len(records), "round_records": records}


def report(result: dict[str, Any]) -> None:
    """The table on stdout."""
    modes = result["modes"]
    base = modes.get("sync-wait", {}).get("samples_per_s")
    print(f"\ntrainer step {result['train_s']:.1f} s; samples/s = samples handed to the trainer / wall time of the "
          "loop (rollouts, trainer sleeps and updates)")
    print("staleness: samples returned per number of versions their oldest token lags the newest; recomputed: "
          "tokens the server prefilled again to continue requests under new weights")
    print("pause: seconds the server held generation per update; recovery: seconds after an update until the "
          f"token rate is back to {RECOVERED:.0%} of the rate before it")
    print(f"{'mode':<24}{'samples/s':>10}{'vs sync-wait':>14}{'discarded tok':>15}{'recomputed tok':>16}"
          f"{'useful tok/s':>14}{'median step s':>15}{'median update s':>17}{'pause s':>9}{'recovery s':>12}"
          f"{'staleness':>22}")
    for mode, row in modes.items():
        speedup = f"{row['samples_per_s'] / base:>13.2f}x" if base else f"{'-':>14}"
        stale = ",".join(f"{k}:{v}" for k, v in row["staleness"].items())
        recomputed = row["server"].get("recomputed_tokens", 0.0)
        recovery = f"{statistics.median(row['recovery_s']):>12.2f}" if row.get("recovery_s") else f"{'-':>12}"
        print(f"{mode:<24}{row['samples_per_s']:>10.2f}{speedup}{row['discarded_tokens']:>15}{recomputed:>16.0f}"
              f"{row['useful_tokens_per_s']:>14.1f}{statistics.median(row['step_s']):>15.1f}"
              f"{statistics.median(row['update_s']):>17.2f}{mean_pause_s(row['server']):>9.2f}{recovery}{stale:>22}")


def mean_pause_s(server: dict[str, float]) -> float:
    """Seconds the server held generation per weight update, over the updates it counted (any mode)."""
    count = sum(v for k, v in server.items() if k.startswith("pause_count_"))
    return sum(v for k, v in server.items() if k.startswith("pause_sum_")) / count if count else 0.0


COLORS = ["#888888", "#cc7744", "#3377bb", "#33aa77", "#aa55aa", "#bbaa33"]


def plot(result: dict[str, Any], path: Path) -> None:
    """Samples per second and discarded tokens per mode, side by side."""
    from plotting import save, subplots

    modes = list(result["modes"])
    fig, axes = subplots(1, 2, figsize=(10, 3.8))
    rates = [result["modes"][m]["samples_per_s"] for m in modes]
    axes[0].bar(modes, rates, color=COLORS[:len(modes)])
    axes[0].set_ylabel("samples / s")
    axes[0].set_title(f"throughput (trainer step {result['train_s']:.1f} s)")
    for x, rate in enumerate(rates):
        axes[0].annotate(f"{rate:.2f}", (x, rate), ha="center", va="bottom")
    discarded = [result["modes"][m]["discarded_tokens"] for m in modes]
    axes[1].bar(modes, discarded, color=COLORS[:len(modes)])
    axes[1].set_ylabel("tokens")
    axes[1].set_title("generated tokens discarded")
    for x, count in enumerate(discarded):
        axes[1].annotate(f"{count}", (x, count), ha="center", va="bottom")
    save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the module docstring says what it measures)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES),
                        help="comma-separated; an async mode with -sK (async-continue-s2) has --max-staleness K")
    parser.add_argument("--steps", type=int, default=5, help="trainer steps per mode")
    parser.add_argument("--groups", type=int, default=8, help="GRPO groups per batch (prompts per step)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-s", type=float, default=None,
                        help="the trainer's sleep (default: the median rollout time of the calibration steps)")
    parser.add_argument("--calibration-steps", type=int, default=1)
    parser.add_argument("--oversample", type=float, default=0.5,
                        help="sync-abort: groups sent per step beyond --groups, as a fraction of it")
    parser.add_argument("--max-concurrent-groups", type=int, default=None,
                        help="async-continue: groups generating at once (default: 2 x --groups)")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="async-continue: restart samples whose oldest token lags more versions (default: none)")
    parser.add_argument("--max-in-flight", type=int, default=256, help="the client's requests outstanding, at most")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="engine slots")
    parser.add_argument("--rollout-scheduling", choices=["length-aware", "fcfs"], default="length-aware",
                        help="the server's policy (its default); it remembers no prompt's lengths here "
                        "(--scheduling-history 0), so a mode run after another on the same prompts is not "
                        "scheduled with knowledge the first one lacked")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="the server's KV cache")
    parser.add_argument("--json", dest="json_path", type=Path, nargs="?",
                        const=HERE / "results" / "async-rollout-cpu.json", default=None,
                        help="write the results (default path: bench/results/async-rollout-cpu.json)")
    parser.add_argument("--plot", type=Path, nargs="?", const=HERE / "results" / "async-rollout-cpu.png",
                        default=None, help="draw them (default path: bench/results/async-rollout-cpu.png)")
    parser.add_argument("--servers", type=int, default=1,
                        help="servers to start (more than one: each engine bound to a core of its own)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every mode, interleaved (median taken)")
    parser.add_argument("--record", type=Path, default=None,
                        help="write every group each mode and round ran to DIR/<mode>-<round>.jsonl.gz")
    parser.add_argument("--log", type=Path, default=Path("/tmp/samrollout-async-rollout-bench.log"))
    parser.add_argument("--panels", type=Path, default=None,
                        help="run a Prometheus scraping the servers (with deploy/prometheus/rules.yml) and draw the "
                        "Grafana dashboard's panels over the whole run to this PNG (deploy/render_panels.py)")
    args = parser.parse_args(argv)
    unknown = {m for m in args.modes if m not in MODES and not BOUNDED.match(m)}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}, or an async mode with -sK "
                     "(max_staleness K)")
    return args


def start_servers(args: argparse.Namespace) -> list[Any]:
    """``--servers`` servers of the built-in model; with more than one, each engine's threads bound to one core."""
    from samrollout.models import ensure_smollm2
    from samrollout.testing import start_server

    ensure_smollm2()  # converted once, before the servers start
    cores = os.cpu_count() or 1
    servers = []
    try:
        for index in range(args.servers):
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(index % cores)} if args.servers > 1 else None
            log = args.log.with_name(f"{args.log.stem}-{index}{args.log.suffix}") if args.servers > 1 else args.log
            print(f"starting server {index + 1}/{args.servers} (log: {log}) ...", file=sys.stderr, flush=True)
            servers.append(start_server(["--served-model-name", "bench", "--max-model-len", "1024", "--max-num-seqs",
                                         str(args.max_num_seqs), "--rollout-scheduling", args.rollout_scheduling,
                                         "--scheduling-history", "0", "--log-level", "warning", "--",
                                         "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))], log, env))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def watch_with_prometheus(servers: list[Any]) -> Any:
    """A Prometheus scraping ``servers`` every second with the deployment's rules (`--panels`)."""
    from samrollout.testing import start_prometheus

    work = Path(tempfile.mkdtemp(prefix="samrollout-bench-prometheus-"))
    return start_prometheus([urlsplit(server.url).netloc for server in servers], work,
                            HERE.parent / "deploy" / "prometheus" / "rules.yml")


def draw_panels(prometheus_url: str, minutes: float, out: Path) -> None:
    """The dashboard's panels over the last ``minutes``, drawn to ``out`` by deploy/render_panels.py."""
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(HERE.parent / "deploy" / "render_panels.py"), "--prometheus", prometheus_url,
                    "--minutes", f"{minutes:.1f}", "--scrape-interval", "1", "--out", str(out)], check=True)


def main() -> None:
    """Start the servers, run the modes, print the table, write the JSON, the plot and the panels."""
    args = parse_args()
    from samrollout.models import ensure_smollm2

    servers = start_servers(args)
    prometheus = watch_with_prometheus(servers) if args.panels else None
    began = time.time()
    try:
        result = asyncio.run(run(args, [server.url for server in servers], str(ensure_smollm2())))
        if prometheus is not None:
            draw_panels(prometheus.url, (time.time() - began) / 60 + 0.5, args.panels)
    finally:
        for server in [*servers, *([prometheus] if prometheus else [])]:
            server.stop()
    result.update({
        "command": " ".join(["bench/async_rollout.py", *sys.argv[1:]]),
        "model": "SmolLM2-135M-Instruct (built-in)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **host()})
    base = result["modes"].get("sync-wait", {}).get("samples_per_s")
    if base:
        result["samples_per_s_vs_sync_wait"] = {m: r["samples_per_s"] / base for m, r in result["modes"].items()}
    report(result)
    if args.json_path:
        write_json(args.json_path, result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)


if __name__ == "__main__":
    main()
