"""Shared fixtures: the built-in models (converted once, cached) and a runner for real engine jobs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import pytest

from samrollout.models import build_tiny_model, cache_root, ensure_smollm2
from samrollout.server.weights.load_holds import HOLD_DIR_ENV
from samrollout.testing import free_port

HERE = Path(__file__).parent
# Engine settings every engine test uses: vLLM on this CPU wants <= 0.3 of memory; float32
# keeps numerics identical whether a position is computed alone or inside a verification pass.
ENGINE = {"gpu_memory_utilization": 0.3, "max_model_len": 2048, "dtype": "float32", "seed": 0,
          "disable_log_stats": False, "enforce_eager": True}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir: Path) -> Path:
    return build_tiny_model(cache_root() / "models" / "tiny-random-llama", smollm2_dir)


@pytest.fixture(scope="session")
def contract_probes(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The serving-contract probe's results on each vLLM release it checks (tests/support/vllm_probe.py), run side
    by side once for the release modules (test_vllm0*_serving_contract.py)."""
    from support.vllm_contract import run_probes

    return run_probes(tiny_dir, tmp_path_factory.mktemp("vllm-probes"))


@dataclass(frozen=True)
class EngineRun:
    """One fresh engine running ``jobs`` (tests/support/engine_jobs.py): the model, speculation (None: off), where
    its files go, engine settings over `ENGINE`, and environment variables over this process's."""

    model: Path
    speculation: dict[str, Any] | None
    jobs: list[dict[str, Any]]
    workdir: Path
    engine: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    expected_s: float = 0.0  # about how long it runs on one CPU: `planned_engine_runs` starts the longest first


def _run_together(runs: Sequence[EngineRun]) -> list[dict[str, Any] | Exception]:
    """Each run's JSON (or its error, in its place: the other runs go on), in order; as many engines at once as
    this process has CPUs, each on CPUs of its own.

    The tiny model's engine spends most of its time in single-threaded Python (scheduling,
    drafting), so two side by side, one CPU each, beat two in turn on both (its exactness pair:
    52 s instead of 74 s on 2 cores).  SmolLM2's is compute-bound, but its start-up (imports,
    single-threaded) is not: side by side, the start-ups overlap.  Runs compared token for token
    must use the same function: each runs with as many compute threads as it has CPUs.  Engines running at once
    share `ENGINE`'s memory reservation (a run may set its own).
    """
    cpus = sorted(os.sched_getaffinity(0))
    slots = max(1, min(len(runs), len(cpus)))
    free: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    for group in range(slots):  # disjoint CPU groups of one size (the same function), one per engine running
        free.put(cpus[group::slots][:len(cpus) // slots])
    share = {"gpu_memory_utilization": ENGINE["gpu_memory_utilization"] / slots}

    def on_free_cpus(run: EngineRun) -> dict[str, Any] | Exception:
        group = free.get()
        try:
            return _run(replace(run, engine={**share, **run.engine}), group)
        except Exception as error:  # handed back in its run's place
            return error
        finally:
            free.put(group)

    with ThreadPoolExecutor(max_workers=slots) as pool:
        return list(pool.map(on_free_cpus, runs))


EnginePlan = Callable[[Path, Path, Path], dict[str, EngineRun]]
"""A module's ``engine_plan(tiny_dir, smollm2_dir, workdir)``: the engine runs its tests compare, by name."""


@pytest.fixture(scope="session")
def planned_engine_runs(request: pytest.FixtureRequest, tiny_dir: Path, smollm2_dir: Path,
                        tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, Any] | Exception]]:
    """Every collected module's `EnginePlan` (its ``engine_plan``) run once, in one pool: module -> run -> JSON.

    One `_run_together` for all of them, the longest runs first (`EngineRun.expected_s`): run per
    module, each module's last engine ran alone with the other CPUs idle (about a minute of one of two CPUs
    for the SmolLM2 runs of test_sampled_exactness.py); in one pool, the short runs of the other module fill
    them.  A run that fails fails the tests of its own module only (`planned_runs` raises it there).
    """
    plans: dict[str, EnginePlan] = {}
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "engine_plan"):
            plans.setdefault(module.__name__, module.engine_plan)
    runs = {(module, name): run for module, plan in plans.items()
            for name, run in plan(tiny_dir, smollm2_dir, tmp_path_factory.mktemp(module)).items()}
    order = sorted(runs, key=lambda key: -runs[key].expected_s)  # stable: a plan's order among equals
    outcomes = dict(zip(order, _run_together([runs[key] for key in order]),
                        strict=True))
    return {module: {name: outcomes[module, name] for (owner, name) in runs if owner == module} for module in plans}


def planned_runs(planned: dict[str, dict[str, dict[str, Any] | Exception]], module: str) -> dict[str, dict[str, Any]]:
    """Module ``module``'s runs from `planned_engine_runs` (its JSON by run name); raises the first that failed."""
    runs: dict[str, dict[str, Any]] = {}
    for name, outcome in planned[module].items():
        if isinstance(outcome, Exception):
            raise outcome
        runs[name] = outcome
    return runs


def _run(run: EngineRun, cpus: list[int]) -> dict[str, Any]:
    """One engine on ``cpus``, one compute thread per CPU (vLLM would run an in-process engine on one)."""
    run.workdir.mkdir(parents=True, exist_ok=True)
    spec_file, out_file = run.workdir / "jobs.json", run.workdir / "out.json"
    spec_file.write_text(json.dumps({"model": str(run.model), "speculation": run.speculation,
                                     "engine": {**ENGINE, **run.engine}, "jobs": run.jobs}))
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus)),
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in cpus), **run.env}
    proc = subprocess.run([sys.executable, str(HERE / "support" / "engine_jobs.py"), str(spec_file), str(out_file)],
                          capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"engine jobs failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(out_file.read_text())
    result["workdir"] = str(run.workdir)  # where the run wrote its files (logs its environment asked for)
    return result


# --- the HTTP server, started once per test session (samrollout.testing) ---
API_KEY = "test-key"
# Fraction of this machine's memory each tiny-model server reserves (KV cache); several run at once.
TINY_SERVER_MEMORY = 0.05  # 1.2 GB: about 0.4 GB of KV cache, 400,000 tokens of the tiny model
TINY_CONTEXT = 512            # the tiny server's --max-model-len
TINY_MAX_PROMPT_TOKENS = 480  # the tiny server's --max-prompt-tokens
TINY_CHUNK_TOKENS = 128       # the tiny server's prefill chunk (vLLM's --max-num-batched-tokens)


# The ports of the servers that name each other as weight peers, chosen before either starts; one where nothing
# listens (a peer that never answers); and the port of a server a test kills in the middle of a relay
# (test_weight_push_split.py: `second_tiny_server` names it as a peer, and nothing listens there before or after).
PEER_PORTS = {"tiny_server": free_port(), "second_tiny_server": free_port(), "silent_peer": free_port(),
              "relay_victim": free_port()}


def peer_url(name: str) -> str:
    """The URL `PEER_PORTS` gives server ``name``."""
    return f"http://127.0.0.1:{PEER_PORTS[name]}"


def tiny_server_args(tiny_dir: Path) -> list[str]:
    """`tiny_server`'s flags: SAM on, an API key, a 512-token context, n <= 16, prompts of at most 480 tokens;
    its weight peers: `second_tiny_server` and a silent one."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY,
            "--max-model-len", str(TINY_CONTEXT), "--max-prompt-tokens", str(TINY_MAX_PROMPT_TOKENS),
            "--max-n", "16", "--dtype", "float32", "--gpu-memory-utilization", str(TINY_SERVER_MEMORY),
            "--threshold-mode", "static",
            "--weight-peers", f"{peer_url('second_tiny_server')},{peer_url('silent_peer')}",
            # small prefill chunks: long prompts (and seeded ones) are prefilled over several steps
            "--", "--max-num-batched-tokens", str(TINY_CHUNK_TOKENS)]


def second_tiny_server_args(tiny_dir: Path) -> list[str]:
    """`second_tiny_server`'s flags: speculation at its defaults, an API key, a 512-token context."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY,
            "--max-model-len", str(TINY_CONTEXT), "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


def second_tiny_server_with_peer_args(tiny_dir: Path) -> list[str]:
    """`second_tiny_server`'s own flags: those, and `tiny_server` and the relay's victim as its weight peers."""
    peers = f"{peer_url('tiny_server')},{peer_url('relay_victim')}"
    return [*second_tiny_server_args(tiny_dir), "--weight-peers", peers]


# The session's shared servers, by fixture name.  Each starts as the session starts when a collected test
# needs it (`pytest_collection_finish`), side by side with the others and with the first tests: a start is
# mostly single-threaded imports (about 40 s each on 2 cores, one after the other).  `tiny_server_to_kill` is
# the one a test kills (test_client.py, early in the session: its memory is back long before the exactness
# modules' engines).
SHARED_SERVERS = {"tiny_server": tiny_server_args, "second_tiny_server": second_tiny_server_with_peer_args,
                  "tiny_server_to_kill": second_tiny_server_args}
ServerArgs = Callable[[Path], list[str]]
"""A server's ``samrollout serve`` flags, given the tiny model's directory."""
# Servers of their own modules (`server_fixture`), by fixture name: launched ahead of their first test.
AHEAD_SERVERS: dict[str, ServerArgs] = {}
AHEAD_ENV: dict[str, dict[str, str]] = {}  # fixture name -> what its server's environment adds
# Launching servers ahead is held to this share of the machine's memory, counting every server alive: each
# reserves its --gpu-memory-utilization (0.3 when not given: the CPU default) plus SERVER_PROCESS_MEMORY.
AHEAD_MEMORY = 0.75
SERVER_PROCESS_MEMORY = 0.07  # its three processes (API server, engine core, worker): about 1.7 GB of 24 GiB
_launched: dict[str, Any] = {}  # fixture name -> ServerProcess launched, not yet handed to its fixture


@dataclass
class _Launches:
    """The servers launched here (`_launch`) and those still to launch ahead (`pytest_runtest_setup`)."""

    alive: list[tuple[Any, float]] = field(default_factory=list)  # (ServerProcess, its memory share), ended or not
    ahead: list[tuple[int, str]] = field(default_factory=list)  # (place of the first test it may launch at, name)
    place: dict[str, int] = field(default_factory=dict)  # test node id -> its place in the run
    first_use: dict[str, int] = field(default_factory=dict)  # server fixture name -> the place of its first test
    current: int = -1  # the place of the test running
    tiny: Path | None = None  # the tiny model's directory
    logs: Path | None = None  # where their logs go

    def held(self) -> float:
        """The memory share of the servers launched here that are still running."""
        return sum(share for server, share in self.alive if server.process.poll() is None)


_launches = _Launches()


def _memory_share(args: list[str]) -> float:
    """The share of the machine's memory a server with flags ``args`` holds (`AHEAD_MEMORY`)."""
    flag = "--gpu-memory-utilization"
    reserved = float(args[args.index(flag) + 1]) if flag in args else 0.3
    return reserved + SERVER_PROCESS_MEMORY


def _launch(args: list[str], log: Path, port: int | None = None, env: dict[str, str] | None = None) -> Any:
    """`samrollout.testing.launch_server` (returns at once; on ``port`` if given, ``env`` added to its
    environment), the server counted in `_launches`."""
    from samrollout.testing import launch_server

    server = launch_server(args, log, env, port=port)
    _launches.alive.append((server, _memory_share(args)))
    return server


def _pool_place(items: Sequence[pytest.Item]) -> int | None:
    """The place of the first test that takes `planned_engine_runs`: the whole pool of engines runs there, once."""
    return next((i for i, item in enumerate(items) if "planned_engine_runs" in getattr(item, "fixturenames", ())),
                None)


_SESSION_ENVIRON = dict(os.environ)
"""The environment before any test module was imported: some packages they import change it (AReaL sets
OPENAI_API_KEY, OPENAI_BASE_URL and others), and the servers and clients of other modules must not inherit that."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Put back the environment the test modules' imports changed (`_SESSION_ENVIRON`); launch the shared servers
    the collected tests need (the fixtures wait for them), and plan when to launch each `AHEAD_SERVERS` server: in
    the order of their first tests, within `AHEAD_MEMORY` (`pytest_runtest_setup`), and one whose first test comes
    after the engine pool's (`_pool_place`) only after the pool (its memory)."""
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRON)
    if session.config.option.collectonly:
        return
    items = session.items
    needed = [name for name in SHARED_SERVERS if any(name in getattr(item, "fixturenames", ()) for item in items)]
    firsts = {}
    for name in [*AHEAD_SERVERS, *needed]:
        firsts[name] = next((i for i, item in enumerate(items) if name in getattr(item, "fixturenames", ())), None)
    _launches.first_use.update((name, first) for name, first in firsts.items() if first is not None)
    pool = _pool_place(items)
    for name, first in sorted(((n, f) for n, f in firsts.items() if f is not None and n in AHEAD_SERVERS),
                              key=lambda entry: entry[1]):
        barrier = pool if pool is not None and pool < first else -1
        _launches.ahead.append((barrier + 1, name))
    if not needed and not _launches.ahead:
        return
    _launches.place.update((item.nodeid, i) for i, item in enumerate(items))
    _launches.tiny = build_tiny_model(cache_root() / "models" / "tiny-random-llama", ensure_smollm2())
    _launches.logs = Path(tempfile.mkdtemp(prefix="samrollout-test-servers-"))
    for name in needed:
        _launched[name] = _launch(SHARED_SERVERS[name](_launches.tiny), _launches.logs / f"{name}.log",
                                  PEER_PORTS.get(name))
    _prioritise()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before ``item``'s fixtures: launch the next `AHEAD_SERVERS` server if its turn has come (`_launch_ahead`)."""
    _launches.current = _launches.place.get(item.nodeid, -1)
    _launch_ahead()


def _launch_ahead() -> None:
    """Launch the next `AHEAD_SERVERS` servers (in the order of their first tests) that the test running may launch,
    while the servers alive then hold at most `AHEAD_MEMORY` of the machine's memory (else tried again before the
    next test, and as a server is taken)."""
    while _launches.ahead and _launches.ahead[0][0] <= _launches.current and _launches.tiny and _launches.logs:
        name = _launches.ahead[0][1]
        args = AHEAD_SERVERS[name](_launches.tiny)
        if _launches.held() + _memory_share(args) > AHEAD_MEMORY:
            return
        _launches.ahead.pop(0)
        _launched[name] = _launch(args, _launches.logs / f"{name}.log", PEER_PORTS.get(name), AHEAD_ENV.get(name))
        _prioritise()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the servers launched for tests that never ran (a run stopped early); wait for those stopping."""
    while _launched:
        stop_in_background(_launched.popitem()[1])
    for stopping in _stopping:
        stopping.join()


_stopping: list[threading.Thread] = []


def stop_in_background(server: Any) -> None:
    """SIGTERM ``server`` and go on: vLLM's engine takes about 8 s to exit (its worker, then a 5 s grace), time
    the next tests can use; `pytest_sessionfinish` waits for each.  Until it has exited it still counts against
    `AHEAD_MEMORY` (`_Launches.held`)."""
    stopping = threading.Thread(target=server.stop, name=f"stopping {server.url}", daemon=True)
    stopping.start()
    _stopping.append(stopping)


def shared_server(name: str, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shared server ``name`` once it answers: the one launched at the session's start, else started now."""
    return take_server(name, SHARED_SERVERS[name], tiny_dir, tmp_path_factory)


def take_server(name: str, args: ServerArgs, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The server ``name`` once it answers: the one launched ahead for it, else one with flags ``args`` now."""
    server = _launched.pop(name, None)
    if server is None:  # not launched ahead (no memory for it yet): started now, and never launched ahead after
        _launches.ahead = [(place, ahead) for place, ahead in _launches.ahead if ahead != name]
        server = _launch(args(tiny_dir), tmp_path_factory.mktemp(name) / "server.log", PEER_PORTS.get(name),
                         AHEAD_ENV.get(name))
    _prioritise(taking=server)
    server.ready()
    _launch_ahead()  # the next one may start now
    return server


NICE_STEP = 5  # the niceness between two starting servers, one needed after the other (`_prioritise`)


def _prioritise(taking: Any = None) -> None:
    """Give the CPU to the starting server needed first: the server a test is waiting for (``taking``) and those
    already serving run at niceness 0, the others still starting at `NICE_STEP` more for each server needed
    before them (by their first test).  A start is mostly single-threaded imports: side by side, starts fill
    both CPUs, but shared equally each is ready only when all are, and the first test waits for the last.
    Raising a process's priority again needs root (CI's case); elsewhere nothing is changed."""
    if os.geteuid() != 0:
        return
    starting = sorted((name for name, server in _launched.items() if server is not taking),
                      key=lambda name: _launches.first_use.get(name, 1 << 30))
    ranks = {id(_launched[name]): rank + (taking is not None) for rank, name in enumerate(starting)}
    for server, _ in _launches.alive:
        _renice(server.process.pid, min(19, NICE_STEP * ranks.get(id(server), 0)))


def _renice(pid: int, niceness: int) -> None:
    """Set the niceness of process ``pid`` and of its children (a server's engine core and worker)."""
    import psutil

    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if process.nice() != niceness:
                    process.nice(niceness)
    except psutil.Error:  # ended
        pass


def server_fixture(name: str, args: ServerArgs, scope: Literal["session", "module", "function"] = "module",
                   env: dict[str, str] | None = None) -> Any:
    """A fixture ``name``: `samrollout serve` with flags ``args`` (and ``env`` added to its environment), launched
    ahead of its first test (`AHEAD_SERVERS`), stopped with SIGTERM after its last.

    For a module's own server: its start (about 45 s, mostly single-threaded imports) overlaps the tests
    before it instead of leaving a CPU idle.
    """
    AHEAD_SERVERS[name] = args
    if env:
        AHEAD_ENV[name] = env

    @pytest.fixture(scope=scope, name=name)
    def fixture(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
        server = take_server(name, args, tiny_dir, tmp_path_factory)
        yield server
        stop_in_background(server)

    return fixture


@pytest.fixture(scope="session")
def tiny_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """`samrollout serve` on the tiny model, SAM on, an API key set; stopped with SIGTERM at the end.

    Limits: a 512-token context, n <= 16, prompts of at most 480 tokens (TINY_MAX_PROMPT_TOKENS).
    """
    server = shared_server("tiny_server", tiny_dir, tmp_path_factory)
    yield server
    stop_in_background(server)


@pytest.fixture(scope="session")
def second_tiny_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A second `samrollout serve` on the tiny model, speculation at its defaults, an API key set.

    Shared by the modules that need a second server (several endpoints) or one they may pause, sleep
    and push weights to; each takes it through `support.weight_swap.swapping_weights`, so it leaves
    the server on the weights and version it found.  One start instead of one per module.
    """
    server = shared_server("second_tiny_server", tiny_dir, tmp_path_factory)
    yield server
    stop_in_background(server)


WEIGHT_LOAD_HOLDS = Path(tempfile.mkdtemp(prefix="samrollout-weight-load-holds-"))
"""Where a test holds `held_server`'s weight loads at a point: while ``hold-<point>`` exists there, a load waits
at that point (`samrollout.server.weights.load_holds`), standing for a slow disk or load without a clock."""
atexit.register(shutil.rmtree, WEIGHT_LOAD_HOLDS, ignore_errors=True)


def held_server_args(tiny_dir: Path) -> list[str]:
    """No key (loopback), AReaL's routes, loads from any path: for weight loads held mid-way and no-key checks."""
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--areal-routes", "--allow-any-weights-path",
            "--max-model-len", str(TINY_CONTEXT), "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


held_server = server_fixture("held_server", held_server_args, scope="session",
                             env={HOLD_DIR_ENV: str(WEIGHT_LOAD_HOLDS)})


@pytest.fixture(scope="session")
def tiny_server_to_kill(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny server (`second_tiny_server`'s flags) for the one test that kills it; stopped at the end if alive."""
    server = shared_server("tiny_server_to_kill", tiny_dir, tmp_path_factory)
    yield server
    stop_in_background(server)


@pytest.fixture(scope="session")
def tiny_weights_v2(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other random weights of the tiny model's architecture: a 'new policy' for weight updates."""
    return build_tiny_model(tmp_path_factory.mktemp("weights") / "tiny-v2", smollm2_dir, seed=1)


def admin_status(server: Any) -> dict[str, Any]:
    """A running server's ``GET /admin/status`` (servers of these tests use `API_KEY`)."""
    import httpx

    reply = httpx.get(f"{server.url}/admin/status", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result
