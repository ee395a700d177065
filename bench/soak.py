"""Soak: long mixed load on one real server; lost requests, leaks (RSS, descriptors, threads) and latency by phase.

    python bench/soak.py --minutes 30 --json bench/results/soak-cpu.json --plot bench/results/soak-cpu.png

Starts `samrollout serve` with the built-in SmolLM2-135M (an API key, SAM on, its defaults, and
AReaL's routes on the trainer's own port, loads confined to a weights root) and runs, for
``--minutes``, a cycle of phases (``--phase-seconds`` each):

- ``steady``: rollouts through the Python client (groups of 4, 48 tokens, T=1) and completions
  through the official openai client (``n=4``, a group id);
- ``burst``: 48 completions sent at once;
- ``cut_streams``: streams hung up after their third chunk;
- ``aborts``: rollouts aborted mid-way with ``/admin/abort_rollout``;
- ``pause``: ``/admin/pause`` for two seconds with requests in flight, then ``/admin/resume``.

Throughout, a weight push every ``--push-every`` seconds (0: none; the built-in checkpoint through
``/admin/weight_uploads``) and a stream of bad requests (malformed JSON, a wrong key, token
ids outside the vocabulary, a 40 MB declared body, a NaN checkpoint, headers never finished,
an idle connection), each of which must get its 4xx (or be closed) and nothing else; and every
``--hostile-every`` seconds the calls issue 59 found could freeze or exhaust a server
(`hostile_calls`: a 400 KB path on the trainer's port, unauthenticated 30 MB bodies, a foreign
Host and Origin, a text/plain admin POST, a connection flood on the main port, during which the
trainer's port must answer).  ``/health`` is asked twice a second throughout; its worst latency
is reported, with the API process's RSS at the start and the end.  It is timed from a process of
its own (`health_probe`: the load's event loop would add its own lag), beside a control server
that does nothing, timed at the same moments: the control's latency is what the busy machine alone
costs.

A request is *lost* when it gets no answer (connection error or timeout), a 5xx, or a
client rollout misses a sample.  Every ``--sample-seconds`` the server's API process and
engine processes are sampled (RSS, open descriptors, threads) and ``/health`` is checked.
Slopes are least-squares fits after ``--warmup-minutes``, in percent of the mean per 10
minutes, of every sample and of each minute's lowest sample (the floor: descriptors and
threads rise and fall with the connections open at the moment, a leak lifts the floor).
The drafting history's size is sampled too (``/admin/status``): it grows by design up to
``--draft-history-tokens`` and explains part of the engine's RSS growth in a short run.
Latency p50/p99 are per phase (request kinds within it).  The JSON keeps the samples; the
plot shows RSS, descriptors and threads over time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness import percentile, write_json
from health_probe import HealthProbe, summarise_checks
from hostile_calls import hostile_round
from plotting import save, subplots
from provenance import command_line, git_commit

API_KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PHASES = ("steady", "burst", "cut_streams", "aborts", "pause")
MODEL = "smollm2-135m-instruct"


@dataclass
class Tally:
    """Outcomes and latencies of every request, by phase and kind."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    outcomes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    lost: list[str] = field(default_factory=list)

    def record(self, phase: str, kind: str, seconds: float, outcome: str) -> None:
        """One request: its latency (answered ones) and outcome; a lost one is also listed with its reason."""
        self.outcomes[f"{phase}/{kind}"][outcome] += 1
        if outcome.startswith("lost"):
            self.lost.append(f"{phase}/{kind}: {outcome}")
        else:
            self.latencies[phase].append(seconds)


def _outcome(status: int, expected: tuple[int, ...] = (200,)) -> str:
    if status in expected:
        return "ok"
    return f"lost: HTTP {status}" if status >= 500 else f"unexpected {status}"


async def completion(http: httpx.AsyncClient, url: str, tally: Tally, phase: str, tokens: int = 48) -> None:
    """One sampled completion; answered or lost."""
    start = time.perf_counter()
    try:
        reply = await http.post(f"{url}/v1/completions", json={"model": "smollm2-135m-instruct", "max_tokens": tokens,
                                                               "prompt": "Count the primes below fifty:",
                                                               "temperature": 1.0})
        tally.record(phase, "completion", time.perf_counter() - start, _outcome(reply.status_code, (200, 429)))
    except httpx.HTTPError as error:
        tally.record(phase, "completion", time.perf_counter() - start, f"lost: {type(error).__name__}")


async def rollout(client: Any, tally: Tally, phase: str, rollout_id: str, groups: int = 3) -> None:
    """A client rollout of ``groups`` x 4 samples; any missing sample is lost (an abort's cut samples are not)."""
    from samrollout_client import RolloutFailed, Sampling

    start = time.perf_counter()
    try:
        result = await client.generate([f"Problem {i}: add {i} and {i * 7}." for i in range(groups)], n=4,
                                       sampling=Sampling(max_tokens=48, temperature=1.0), rollout_id=rollout_id)
        missing = sum(4 - len(group.samples) for group in result)
        tally.record(phase, "rollout", time.perf_counter() - start, "ok" if not missing else f"lost: {missing} missing")
    except RolloutFailed as error:
        tally.record(phase, "rollout", time.perf_counter() - start, f"lost: {error}"[:200])


async def openai_group(openai: Any, tally: Tally, phase: str, group_id: str) -> None:
    """Four siblings of one group through the official openai client; fewer than four choices is a loss."""
    import openai as openai_errors

    start = time.perf_counter()
    try:
        reply = await openai.completions.create(model=MODEL, prompt="Name a prime and explain why:", n=4,
                                                max_tokens=32, temperature=1.0, extra_body={"group_id": group_id})
        missing = 4 - len(reply.choices)
        tally.record(phase, "openai_group", time.perf_counter() - start,
                     "ok" if not missing else f"lost: {missing} missing")
    except openai_errors.RateLimitError:
        tally.record(phase, "openai_group", time.perf_counter() - start, "ok")  # a 429: admitted later, not lost
    except openai_errors.OpenAIError as error:
        tally.record(phase, "openai_group", time.perf_counter() - start, f"lost: {type(error).__name__}")


async def cut_stream(http: httpx.AsyncClient, url: str, tally: Tally, phase: str) -> None:
    """A stream the client hangs up on after three chunks."""
    start = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/completions",
                               json={"model": "smollm2-135m-instruct", "prompt": "Tell a long story.",
                                     "max_tokens": 200, "stream": True}) as reply:
            chunks = 0
            async for line in reply.aiter_lines():
                chunks += line.startswith("data:")
                if chunks >= 3:
                    break
        tally.record(phase, "cut_stream", time.perf_counter() - start, _outcome(reply.status_code, (200, 429)))
    except httpx.HTTPError as error:
        tally.record(phase, "cut_stream", time.perf_counter() - start, f"lost: {type(error).__name__}")


async def aborted_rollout(client: Any, http: httpx.AsyncClient, url: str, tally: Tally, phase: str,
                          rollout_id: str) -> None:
    """A rollout aborted after half a second: every sample must come back (cut short, finish_reason abort)."""
    from samrollout_client import Sampling

    start = time.perf_counter()
    task = asyncio.create_task(client.generate(["Write a long essay about rivers."], n=4,
                                               sampling=Sampling(max_tokens=400, temperature=1.0),
                                               rollout_id=rollout_id))
    await asyncio.sleep(0.5)
    await http.post(f"{url}/admin/abort_rollout", json={"rollout_id": rollout_id})
    try:
        result = await task
        missing = sum(4 - len(group.samples) for group in result)
        tally.record(phase, "aborted_rollout", time.perf_counter() - start,
                     "ok" if not missing else f"lost: {missing} missing")
    except Exception as error:  # any failure of the rollout is a loss, recorded with its reason
        tally.record(phase, "aborted_rollout", time.perf_counter() - start, f"lost: {error}"[:200])


async def paused_window(http: httpx.AsyncClient, url: str, tally: Tally, phase: str) -> None:
    """Requests in flight across a two-second pause: all must finish after the resume."""
    work = [asyncio.create_task(completion(http, url, tally, phase)) for _ in range(8)]
    await asyncio.sleep(0.3)
    await http.post(f"{url}/admin/pause", json={"mode": "keep"})
    await asyncio.sleep(2.0)
    await http.post(f"{url}/admin/resume")
    await asyncio.gather(*work)


def _raw(url: str, data: bytes, linger_s: float = 0.0) -> bytes:
    """Send raw bytes on a new connection; what the server answers before closing (or within 20 s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        if data:
            sock.sendall(data)
        if linger_s:
            time.sleep(linger_s)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        return answer


async def bad_requests(http: httpx.AsyncClient, url: str, tally: Tally, phase: str, nan_dir: Path) -> None:
    """One of each bad request; each must be refused with its 4xx (or closed), never a 5xx or a hang."""
    post = f"{url}/v1/completions"
    checks: list[tuple[str, Any, tuple[int, ...]]] = [
        ("malformed_json", http.post(post, content=b"{not json", headers={"content-type": "application/json"}),
         (400,)),
        ("wrong_key", http.post(post, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), (401,)),
        ("out_of_vocab", http.post(post, json={"model": "smollm2-135m-instruct", "prompt": [10 ** 9]}), (400,)),
        ("nan_weights", http.post(f"{url}/admin/update_weights",
                                  json={"path": str(nan_dir), "version": "nan", "in_flight": "wait"}), (400,)),
    ]
    for kind, call, expected in checks:
        start = time.perf_counter()
        try:
            reply = await call
            tally.record(phase, f"bad/{kind}", time.perf_counter() - start, _outcome(reply.status_code, expected))
        except httpx.HTTPError as error:
            tally.record(phase, f"bad/{kind}", time.perf_counter() - start, f"lost: {type(error).__name__}")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {40 * 1024 * 1024}\r\n\r\n").encode()
    for kind, data, wanted in (("huge_body", head + b"[" * 4096, b"HTTP/1.1 413"),
                               ("unfinished_headers", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                b"HTTP/1.1 408"),
                               ("idle_connection", b"", b"HTTP/1.1 408")):
        start = time.perf_counter()
        answer = await asyncio.to_thread(_raw, url, data)
        outcome = "ok" if answer.startswith(wanted) else f"unexpected {answer[:40]!r}"
        tally.record(phase, f"bad/{kind}", time.perf_counter() - start, outcome)


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants (the API process, the engine core, its workers)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[parent].append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _proc_stats(pid: int) -> dict[str, float] | None:
    """RSS (MB), open descriptors and threads of one process; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "fds": float(len(os.listdir(f"/proc/{pid}/fd"))),
                "threads": float(fields["Threads"].strip())}
    except (OSError, KeyError, ValueError):
        return None


async def sampler(url: str, root: int, samples: list[dict[str, Any]], start: float, every_s: float,
                  stop: asyncio.Event) -> None:
    """Sample the API process and the engine processes (summed) and /health until ``stop``."""
    from samrollout.spec_decode.stats import ProposerStats

    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            api = _proc_stats(root) or {}
            engine: dict[str, float] = defaultdict(float)
            for pid in _process_tree(root)[1:]:
                for key, value in (_proc_stats(pid) or {}).items():
                    engine[key] += value
            try:
                healthy = (await http.get(f"{url}/health")).status_code == 200
                status = (await http.get(f"{url}/admin/status", headers=AUTH)).json()
            except (httpx.HTTPError, ValueError):
                healthy, status = False, {}
            drafter = status.get("drafter")  # {} with speculation off, absent when the server did not answer
            history = ProposerStats.from_json(drafter).history if drafter else None
            samples.append({"t_s": time.perf_counter() - start, "healthy": healthy,
                            "history_tokens": None if history is None else history.tokens,
                            "held_sequences": (status.get("queue") or {}).get("held_sequences"),
                            **{f"api_{k}": v for k, v in api.items()}, **{f"engine_{k}": v for k, v in engine.items()}})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


def slope_pct_per_10min(samples: list[dict[str, Any]], key: str, after_s: float) -> float | None:
    """Least-squares slope of ``key`` over time after ``after_s``, in percent of its mean per 10 minutes."""
    points = [(s["t_s"], s[key]) for s in samples if s["t_s"] >= after_s and key in s]
    if len(points) < 3:
        return None
    mean_t, mean_v = statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0 or mean_v == 0:
        return None
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / var
    return 100.0 * slope * 600.0 / mean_v


def floors(samples: list[dict[str, Any]], key: str, window_s: float = 60.0) -> list[dict[str, Any]]:
    """The lowest value of ``key`` in each ``window_s`` window: the level under the requests in flight.

    Descriptors and threads rise and fall with the connections and streams open at the
    moment of sampling; a leak lifts the floor, the load does not.
    """
    lowest: dict[int, dict[str, Any]] = {}
    for sample in samples:
        if key in sample:
            window = int(sample["t_s"] // window_s)
            if window not in lowest or sample[key] < lowest[window][key]:
                lowest[window] = sample
    return [lowest[w] for w in sorted(lowest)]


def summarise(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, float | None]]:
    """Slopes after warm-up (percent of the mean per 10 minutes) of every sampled level, raw and of its floor.

    The floor's slope over the run's second half is given too: allocator warm-up flattens out as
    the run goes on, a leak keeps its slope.
    """
    keys = ("api_rss_mb", "api_fds", "api_threads", "engine_rss_mb", "engine_fds", "engine_threads")
    half_s = max(warmup_s, samples[-1]["t_s"] / 2) if samples else warmup_s
    return {"slopes_pct_per_10min": {key: slope_pct_per_10min(samples, key, warmup_s) for key in keys},
            "floor_slopes_pct_per_10min": {key: slope_pct_per_10min(floors(samples, key), key, warmup_s)
                                           for key in keys},
            "second_half_floor_slopes_pct_per_10min": {key: slope_pct_per_10min(floors(samples, key), key, half_s)
                                                       for key in keys}}


async def push_loop(client: Any, model_dir: Path, every_s: float, deadline: float,
                    pushes: list[dict[str, Any]]) -> None:
    """A weight push through the real client every ``every_s`` seconds (0: none) until ``deadline``."""
    version = 0
    while every_s > 0 and time.monotonic() < deadline - every_s:
        await asyncio.sleep(every_s)
        version += 1
        start = time.perf_counter()
        try:
            await client.push_weights(model_dir, f"push-{version}")
            pushes.append({"version": version, "seconds": time.perf_counter() - start, "ok": True})
        except Exception as error:  # recorded: a failed push is a finding, not a crash
            pushes.append({"version": version, "seconds": time.perf_counter() - start, "ok": False,
                           "error": str(error)[:300]})


async def every(seconds: float, deadline: float, call: Any) -> None:
    """``await call()`` every ``seconds`` (0: never) until ``deadline``."""
    while seconds > 0 and time.monotonic() < deadline:
        await call()
        await asyncio.sleep(seconds)


async def one_round(phase: str, tag: str, client: Any, openai: Any, http: httpx.AsyncClient, url: str,
                    tally: Tally) -> None:
    """One round of ``phase``'s load."""
    if phase == "steady":
        await asyncio.gather(*(rollout(client, tally, phase, f"{tag}-{i}") for i in range(2)),
                             *(openai_group(openai, tally, phase, f"{tag}-g{i}") for i in range(2)))
    elif phase == "burst":
        await asyncio.gather(*(completion(http, url, tally, phase) for _ in range(48)))
    elif phase == "cut_streams":
        await asyncio.gather(*(cut_stream(http, url, tally, phase) for _ in range(8)))
    elif phase == "aborts":
        await aborted_rollout(client, http, url, tally, phase, tag)
    else:
        await paused_window(http, url, tally, phase)


async def run_load(url: str, trainer_url: str, model_dir: Path, nan_dir: Path, args: argparse.Namespace,
                   tally: Tally, pushes: list[dict[str, Any]]) -> None:
    """The phases in turn until ``--minutes`` pass, with weight pushes, bad and hostile requests alongside."""
    from openai import AsyncOpenAI

    from samrollout_client import AsyncRolloutClient

    deadline = time.monotonic() + args.minutes * 60
    async with AsyncRolloutClient(url, model=MODEL, api_key=API_KEY, max_in_flight=32) as client, \
            httpx.AsyncClient(headers=AUTH, timeout=600) as http, \
            AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=600, max_retries=0) as openai:
        side = [asyncio.create_task(push_loop(client, model_dir, args.push_every, deadline, pushes)),
                asyncio.create_task(every(args.bad_every, deadline,
                                          lambda: bad_requests(http, url, tally, "bad", nan_dir))),
                asyncio.create_task(every(args.hostile_every, deadline,
                                          lambda: hostile_round(http, url, trainer_url, tally)))]
        cycle = 0
        while time.monotonic() < deadline:
            phase = PHASES[cycle % len(PHASES)]
            phase_end = min(deadline, time.monotonic() + args.phase_seconds)
            round_ = 0
            while time.monotonic() < phase_end:
                round_ += 1
                await one_round(phase, f"soak-{cycle}-{round_}", client, openai, http, url, tally)
            cycle += 1
        await asyncio.gather(*side)


def write_plot(samples: list[dict[str, Any]], path: str, warmup_s: float) -> None:
    """RSS, descriptors and threads of the API and engine processes over time."""
    fig, axes = subplots(3, 1, figsize=(9, 8), sharex=True)
    minutes = [s["t_s"] / 60 for s in samples]
    for axis, key, label in zip(axes, ("rss_mb", "fds", "threads"), ("RSS (MB)", "open descriptors", "threads"),
                                strict=True):
        for process in ("api", "engine"):
            axis.plot(minutes, [s.get(f"{process}_{key}", float("nan")) for s in samples], label=process)
        axis.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
        axis.set_ylabel(label)
        axis.legend(loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.suptitle("samrollout soak: mixed load, weight pushes, bad requests (built-in model, CPU)")
    save(fig, path)


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=5.0)
    parser.add_argument("--phase-seconds", type=float, default=40.0)
    parser.add_argument("--push-every", type=float, default=60.0, help="seconds between weight pushes (0: none)")
    parser.add_argument("--bad-every", type=float, default=5.0, help="seconds between rounds of bad requests")
    parser.add_argument("--hostile-every", type=float, default=20.0,
                        help="seconds between rounds of hostile calls (hostile_calls; 0: none)")
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--json", dest="json_path", default="bench/results/soak-cpu.json",
                        help="where the result JSON goes")
    parser.add_argument("--plot")
    return parser.parse_args()


def nan_checkpoint(model_dir: Path, work: Path) -> Path:
    """A copy of the built-in checkpoint with every floating-point tensor NaN, in ``work/nan`` (a bad request)."""
    import torch
    from safetensors.torch import load_file, save_file

    (weights,) = model_dir.glob("*.safetensors")
    nan_dir = work / "nan"
    nan_dir.mkdir()
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for k, v in load_file(str(weights)).items()}, str(nan_dir / weights.name), metadata={"format": "pt"})
    return nan_dir


@dataclass
class SoakRun:
    """What a soak left: every request's outcome, the weight pushes, the samples, and how the server ended."""

    tally: Tally = field(default_factory=Tally)
    pushes: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    health_checks: list[dict[str, float]] = field(default_factory=list)
    commit: str = "unknown"
    alive: bool = False
    exit_code: int = 0


def soak(args: argparse.Namespace) -> SoakRun:
    """Start the server, run the load with the sampler alongside, stop the server."""
    from samrollout.models import ensure_smollm2
    from samrollout.testing import free_port, start_server

    done = SoakRun(commit=git_commit())  # what runs: taken before anything is edited meanwhile
    model_dir = ensure_smollm2()
    work = Path(tempfile.mkdtemp(prefix="samrollout-soak-"))
    nan_dir = nan_checkpoint(model_dir, work)
    trainer_port = free_port()
    server = start_server(["--api-key", API_KEY, "--areal-routes", "--areal-port", str(trainer_port),
                           "--weights-root", str(work)], work / "server.log")
    trainer_url = f"http://127.0.0.1:{trainer_port}"

    async def load_and_watch() -> None:
        stop = asyncio.Event()
        watcher = asyncio.create_task(sampler(server.url, server.process.pid, done.samples, time.perf_counter(),
                                              args.sample_seconds, stop))
        try:
            await run_load(server.url, trainer_url, model_dir, nan_dir, args, done.tally, done.pushes)
        finally:
            stop.set()
            await watcher

    probe = HealthProbe(server.url, work / "health.json")
    probe.start()
    try:
        asyncio.run(load_and_watch())
    finally:
        done.health_checks = probe.stop()
        done.alive = server.process.poll() is None
        done.exit_code = server.stop()
    return done


def report(args: argparse.Namespace, done: SoakRun) -> dict[str, Any]:
    """The result JSON: losses, health, trends after the warm-up, latency by phase, outcomes, pushes, samples."""
    tally, samples = done.tally, done.samples
    phases = {phase: {"requests": len(values), "p50_s": percentile(values, 0.5), "p99_s": percentile(values, 0.99)}
              for phase, values in sorted(tally.latencies.items()) if values}
    rss = [s["api_rss_mb"] for s in samples if "api_rss_mb" in s]
    return {"minutes": args.minutes, "warmup_minutes": args.warmup_minutes,
            "requests_sent": sum(sum(v.values()) for v in tally.outcomes.values()), "lost_requests": len(tally.lost),
            **summarise_checks(done.health_checks),
            "api_rss_mb_start": rss[0] if rss else None, "api_rss_mb_end": rss[-1] if rss else None,
            "lost_examples": tally.lost[:20], "unhealthy_samples": sum(not s["healthy"] for s in samples),
            "server_alive_at_end": done.alive, "server_exit_code": done.exit_code,
            **summarise(samples, args.warmup_minutes * 60), "phases": phases,
            "outcomes": {k: dict(v) for k, v in sorted(tally.outcomes.items())},
            "weight_pushes": done.pushes, "samples": samples, "health": done.health_checks,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "command": command_line("soak.py"), "commit": done.commit}


def print_report(result: dict[str, Any]) -> None:
    """Losses and health, the slopes of every sampled level, the drafting history, latency by phase."""
    worst = result["worst_health_s"]
    print(f"{'requests sent':<28}{result['requests_sent']:>10}")
    print(f"{'requests lost':<28}{result['lost_requests']:>10}")
    print(f"{'worst /health latency (s)':<28}{'n/a' if worst is None else f'{worst:.3f}':>10}")
    for key, label in (("worst_control_s", "worst control latency (s)"),
                       ("worst_health_over_control_s", "worst /health over control")):
        value = result[key]
        print(f"{label:<28}{'n/a' if value is None else f'{value:.3f}':>10}")
    print(f"checks over 1 s: /health {result['health_over_1s']}, control {result['control_over_1s']} "
          f"of {result['health_checks']}")
    for key in ("api_rss_mb_start", "api_rss_mb_end"):
        value = result[key]
        print(f"{key.replace('_', ' '):<28}{'n/a' if value is None else f'{value:.0f}':>10}")
    print(f"lost requests: {result['lost_requests']}; unhealthy samples: {result['unhealthy_samples']}; "
          f"server alive at the end: {result['server_alive_at_end']}, exit code {result['server_exit_code']}")
    pushes = result["weight_pushes"]
    print(f"weight pushes: {sum(p['ok'] for p in pushes)}/{len(pushes)} ok")
    print(f"{'after warm-up, % of the mean per 10 min':<40}{'slope':>10}{'floor slope':>14}{'2nd half':>10}")
    for key, value in result["slopes_pct_per_10min"].items():
        floor = result["floor_slopes_pct_per_10min"][key]
        late = result["second_half_floor_slopes_pct_per_10min"][key]
        print(f"  {key:<38}{'n/a' if value is None else f'{value:+.2f}%':>10}"
              f"{'n/a' if floor is None else f'{floor:+.2f}%':>14}{'n/a' if late is None else f'{late:+.2f}%':>10}")
    held = [s["history_tokens"] for s in result["samples"] if s.get("history_tokens") is not None]
    if held:
        print(f"drafting history: {held[0]} -> {held[-1]} tokens (bounded by --draft-history-tokens)")
    print(f"{'phase':<14}{'requests':>10}{'p50 s':>10}{'p99 s':>10}")
    for phase, row in result["phases"].items():
        print(f"{phase:<14}{row['requests']:>10}{row['p50_s']:>10.3f}{row['p99_s']:>10.3f}")
    unexpected = {k: v for k, v in result["outcomes"].items() if set(v) - {"ok"}}
    if unexpected:
        print("outcomes other than ok:", json.dumps(unexpected))


def main() -> None:
    """Start the server, run the load, print the table, write the JSON (and the plot)."""
    args = parse_args()
    done = soak(args)
    result = report(args, done)
    print_report(result)
    if args.json_path:
        write_json(args.json_path, result, indent=1)
        print(f"wrote {args.json_path}")
    if args.plot:
        write_plot(done.samples, args.plot, args.warmup_minutes * 60)


if __name__ == "__main__":
    main()
