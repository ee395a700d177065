"""samrollout as AReaL's rollout server, driven by AReaL 1.0's own classes against real servers.

What runs here is AReaL's real code: `RemotevLLMEngine` and its `RemoteInfEngine` (server
discovery from ``AREAL_LLM_SERVER_ADDRS``, its workflow executor, its interruption loop and
retries), its `VLLMBackend` (requests and parsing), `RLVRWorkflow` (chat template, reward,
trajectory tensors), and its disk weight update (a process pool waiting on AReaL's name_resolve
for the trainer's "saved" record).  What does not run: AReaL's trainer and FSDP engine; the
tests do what its ``_update_weights_from_disk`` does (pause, save, record, update, continue,
set the version), with a second set of random weights as the "trained" checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("areal", reason="AReaL is installed by `make install-dev`")

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.vllm_remote import RemotevLLMEngine, VLLMBackend
from areal.utils import name_resolve, names
from areal.utils.hf_utils import apply_chat_template
from areal.workflow import RLVRWorkflow
from openai import OpenAI
from transformers import AutoTokenizer

from conftest import TINY_CONTEXT, TINY_SERVER_MEMORY, server_fixture
from samrollout.testing import ServerProcess
from samrollout_client.areal import SamrolloutEngine
from samrollout_client.areal.backend import token_versions
from samrollout_client.areal.engine import SamrolloutInfEngine
from samrollout_client.placement import rendezvous_ranking
from samrollout_client.protocol.prompt_identity import prompt_id
from support.frozen_engine import freeze, in_flight_at_least, step, until

RESPONSE_TOKENS = 40
EXPERIMENT, TRIAL = "samrollout-areal", "test"


# Where the "trainer" saves its checkpoints: the servers' --weights-root (AReaL's update loads only from inside it).
CHECKPOINTS = Path(tempfile.gettempdir()) / f"samrollout-test-areal-checkpoints-{os.getpid()}"


def areal_server_args(tiny_dir: Path) -> list[str]:
    """A tiny-model server with AReaL's routes (no API key: AReaL sends none; on loopback), loading AReaL's
    checkpoints from `CHECKPOINTS` only."""
    CHECKPOINTS.mkdir(exist_ok=True)
    return ["--model", str(tiny_dir), "--served-model-name", "tiny", "--areal-routes",
            "--weights-root", str(CHECKPOINTS), "--max-model-len", str(TINY_CONTEXT), "--dtype", "float32",
            "--gpu-memory-utilization", str(TINY_SERVER_MEMORY)]


areal_server = server_fixture("areal_server", areal_server_args)
areal_server_to_kill = server_fixture("areal_server_to_kill", areal_server_args)


def address(server: ServerProcess) -> str:
    """A server as AReaL names it: host:port."""
    return server.url.removeprefix("http://")


class RecordingBackend(VLLMBackend):  # type: ignore[misc]
    """AReaL's vLLM backend, keeping each reply's tokens and the versions the server says sampled them."""

    def __init__(self) -> None:
        super().__init__()
        self.replies: list[tuple[list[int], list[int] | None]] = []

    def parse_generation_response(self, response: dict[str, Any]) -> Any:
        result = super().parse_generation_response(response)
        tokens = list(result.output_tokens)
        self.replies.append((tokens, token_versions(response["choices"][0], len(tokens))))
        return result


def server_versions(output: list[int], replies: list[tuple[list[int], list[int] | None]]) -> list[int]:
    """The server's version of each token of ``output``, from the replies it was made of (in order)."""
    versions: list[int] = []
    while len(versions) < len(output):
        rest = output[len(versions):]
        match = next(((tokens, spans) for tokens, spans in replies if tokens and rest[:len(tokens)] == tokens), None)
        assert match is not None and match[1] is not None, f"no reply with the server's versions of {rest[:8]}..."
        versions.extend(match[1])
    return versions


@pytest.fixture(scope="module")
def areal_names(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """AReaL's name_resolve in a directory of this module's (where the trainer records each saved checkpoint)."""
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path_factory.mktemp("names"))))
    yield


@pytest.fixture(scope="module", autouse=True)
def _checkpoint_root() -> Iterator[None]:
    """`CHECKPOINTS` removed after the module."""
    yield
    shutil.rmtree(CHECKPOINTS, ignore_errors=True)


@pytest.fixture
def checkpoints(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory of this test's under the servers' weights root, where it saves AReaL's checkpoints."""
    folder = CHECKPOINTS / re.sub(r"\W", "_", request.node.name)
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def engine_config(trial: str) -> InferenceEngineConfig:
    """AReaL's engine config as a user writes it for one data-parallel rollout, with short timeouts."""
    return InferenceEngineConfig(backend="vllm:d1", experiment_name=EXPERIMENT, trial_name=trial,
                                 max_concurrent_rollouts=16, consumer_batch_size=16, setup_timeout=120,
                                 request_timeout=120, request_retries=3)


def start_engine(kind: type[RemotevLLMEngine], servers: list[ServerProcess], trial: str = TRIAL,
                 backend: VLLMBackend | None = None) -> RemotevLLMEngine:
    """An AReaL engine that finds ``servers`` the way AReaL's SPMD launch does: ``AREAL_LLM_SERVER_ADDRS``."""
    engine = kind(engine_config(trial))
    if backend is not None:
        engine._engine.backend = backend
    os.environ["AREAL_LLM_SERVER_ADDRS"] = ",".join(address(server) for server in servers)
    try:
        engine.initialize()
    finally:
        del os.environ["AREAL_LLM_SERVER_ADDRS"]
    return engine


def length_parity(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
                  **_: Any) -> float:
    """A reward AReaL computes in its reward process pool (so a module-level function): the length's parity."""
    return float(len(completion_ids) % 2)


def workflow(tokenizer: Any, **sampling: Any) -> RLVRWorkflow:
    """AReaL's single-turn RLVR workflow with the `length_parity` reward."""
    config = GenerationHyperparameters(max_new_tokens=RESPONSE_TOKENS, **sampling)
    return RLVRWorkflow(reward_fn=length_parity, gconfig=config, tokenizer=tokenizer)


def question(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids AReaL's workflow sends for ``question(text)``."""
    ids: list[int] = apply_chat_template(tokenizer, question(text)["messages"], tokenize=True,
                                         add_generation_prompt=True, enable_thinking=False)
    return ids


def outputs(trajectory: dict[str, Any]) -> list[tuple[list[int], list[float], list[int]]]:
    """Each response of a trajectory (a group): its token ids, logprobs and versions, where the loss mask is 1."""
    result = []
    for row in range(trajectory["input_ids"].shape[0]):
        mask = trajectory["loss_mask"][row].bool()
        result.append((trajectory["input_ids"][row][mask].tolist(), trajectory["logprobs"][row][mask].tolist(),
                       trajectory["versions"][row][mask].tolist()))
    return result


def saved_checkpoint(weights: Path, folder: Path, version: int) -> WeightUpdateMeta:
    """What AReaL's trainer saves for version ``version`` (``.../weight_update_v<N>``, deleted once loaded)."""
    path = folder / f"weight_update_v{version}"
    shutil.copytree(weights, path)
    return WeightUpdateMeta(type="disk", path=str(path))


def update_weights(engine: RemotevLLMEngine, meta: WeightUpdateMeta, version: int, trial: str = TRIAL) -> None:
    """AReaL's FSDP engine's disk update, step by step: pause the servers, update, record the save, wait, continue;
    then the trainer's new version and the executor resumed (`rl_trainer`)."""
    engine.pause_generation()
    future = engine._engine.update_weights_from_disk(meta)
    name_resolve.add(names.update_weights_from_disk(EXPERIMENT, trial, engine.get_version()), str(time.time()),
                     replace=True)
    future.result(timeout=300)
    engine.continue_generation()
    engine.set_version(version)
    engine.resume()


async def two_groups_a_few_tokens_in(client: httpx.AsyncClient, engine: RemotevLLMEngine, tokenizer: Any) -> None:
    """Two groups of 2 long sampled responses submitted to the frozen engine, which then runs 4 steps and holds."""
    await freeze(client)
    for text in ("Name a colour.", "Spell a word."):
        engine.submit(question(text), workflow=workflow(tokenizer, temperature=1.0, ignore_eos=True), group_size=2)
    await held_until_in_flight(client, 4, steps=4)


async def held_until_in_flight(client: httpx.AsyncClient, count: int, steps: int) -> None:
    """Wait (the engine frozen) until ``count`` requests are in flight, then let it run ``steps`` model steps."""
    await until(lambda: in_flight_at_least(client, count), f"{count} requests in flight")
    await step(client, steps)


async def status(client: httpx.AsyncClient) -> dict[str, Any]:
    result: dict[str, Any] = (await client.get("/admin/status", params={"drafter": "false"})).json()
    return result


def test_areal_generates_a_group_with_the_servers_token_ids_and_logprobs(areal_server: ServerProcess,
                                                                            areal_names: None, tokenizer: Any) -> None:
    """AReaL's own engine and workflow: a greedy group of 4 responses to one prompt, each the server's own greedy
    response with its logprobs (the official client asking the server directly), at version 0."""
    engine = start_engine(RemotevLLMEngine, [areal_server])
    try:
        [group] = engine.rollout_batch([question("Count to ten.")], workflow=workflow(tokenizer, greedy=True),
                                       group_size=4)
    finally:
        engine.destroy()
    responses = outputs(group)
    assert len(responses) == 4 and group["rewards"].shape == (4,)
    prompt = prompt_ids(tokenizer, "Count to ten.")
    direct = OpenAI(base_url=f"{areal_server.url}/v1", api_key="none").completions.create(
        model="tiny", prompt=prompt, max_tokens=RESPONSE_TOKENS, temperature=0, logprobs=0,
        extra_body={"return_token_ids": True})
    choice = direct.choices[0]
    for tokens, logprobs, versions in responses:
        assert tokens == choice.token_ids
        assert logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
        assert versions == [0] * len(tokens)


def test_a_weight_update_mid_generation_carries_on_under_the_new_version_with_exact_versions(
        areal_server: ServerProcess, areal_names: None, tokenizer: Any, tiny_dir: Path, tiny_weights_v2: Path,
        checkpoints: Path) -> None:
    """AReaL's own engine through a disk weight update while 2 groups of 2 generate: the pause aborts them, AReaL
    sends each again with its tokens so far, and every response crosses the update; the versions AReaL records are
    the server's for every token (0 before, 1 after), and each response has all its tokens."""
    backend = RecordingBackend()
    engine = start_engine(RemotevLLMEngine, [areal_server], trial="abort", backend=backend)
    aborted_before = _aborted(areal_server)

    async def scenario() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=areal_server.url, timeout=120) as client:
            await two_groups_a_few_tokens_in(client, engine, tokenizer)
            engine.pause()  # AReaL's trainer holds its executor first (rollout.pause())
            await asyncio.to_thread(engine.pause_generation)
            await until(lambda: _none_in_flight(client), "the aborted replies")
            meta = saved_checkpoint(tiny_weights_v2, checkpoints, 1)
            await asyncio.to_thread(update_weights, engine, meta, 1, "abort")
            assert (await status(client))["weight_version"] == "1"
            results = await asyncio.to_thread(engine.wait, 2, 300)
            await asyncio.to_thread(_load_back, engine, tiny_dir, checkpoints, "abort")
            return results

    try:
        results = asyncio.run(scenario())
    finally:
        engine.destroy()
    assert _aborted(areal_server) - aborted_before == 4
    for trajectory in results:
        for tokens, _, versions in outputs(trajectory):
            assert len(tokens) == RESPONSE_TOKENS
            assert versions == server_versions(tokens, backend.replies)
            assert versions[0] == 0 and versions[-1] == 1, "every response crossed the update"


@pytest.mark.parametrize("transfer", ["path", "push"])
def test_samrollout_engine_continues_frozen_requests_under_the_new_weights_with_the_servers_versions(
        transfer: str, areal_server: ServerProcess, areal_names: None, tokenizer: Any, tiny_dir: Path,
        tiny_weights_v2: Path, checkpoints: Path) -> None:
    """`SamrolloutEngine` through the same update, the checkpoint read by the server or pushed to it over HTTP
    (no shared disk): the pause freezes the requests and they go on under the new weights in the same reply (one
    reply each, nothing sent again); AReaL's recorded versions are the server's spans, 0 then 1 within each
    response; the checkpoint is deleted once loaded, as AReaL does."""
    engine = start_engine(SamrolloutEngine, [areal_server], trial=f"continue-{transfer}")
    engine._engine.weight_transfer = transfer
    aborted_before = _aborted(areal_server)

    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=areal_server.url, timeout=120) as client:
            await two_groups_a_few_tokens_in(client, engine, tokenizer)
            engine.pause()
            meta = saved_checkpoint(tiny_weights_v2, checkpoints, 1)
            await asyncio.to_thread(update_weights, engine, meta, 1, f"continue-{transfer}")
            update = (await status(client))["last_weight_update"]
            assert not Path(meta.path).exists()
            results = await asyncio.to_thread(engine.wait, 2, 300)
            await asyncio.to_thread(_load_back, engine, tiny_dir, checkpoints, f"continue-{transfer}")
            return results, update

    try:
        results, update = asyncio.run(scenario())
    finally:
        engine.destroy()
    assert update["in_flight"] == "continue" and update["continued_requests"] == 4
    assert update["weight_version"] == "1"
    assert _aborted(areal_server) == aborted_before, "nothing aborted, so nothing sent again"
    for trajectory in results:
        for tokens, _, versions in outputs(trajectory):
            assert len(tokens) == RESPONSE_TOKENS
            switch = versions.index(1)
            assert switch > 0 and versions == [0] * switch + [1] * (len(tokens) - switch)


def test_pause_holds_new_requests_until_generation_continues(areal_server: ServerProcess, areal_names: None,
                                                             tokenizer: Any) -> None:
    """After AReaL's pause, a new episode's request waits at the server (not refused) and completes on continue."""
    engine = start_engine(RemotevLLMEngine, [areal_server], trial="pause")

    async def scenario() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=areal_server.url, timeout=120) as client:
            await asyncio.to_thread(engine.pause_generation)
            engine.submit(question("Say hello."), workflow=workflow(tokenizer, temperature=1.0), group_size=1)
            await until(lambda: _gate_holds(client), "the request to wait at the gate")
            assert (await status(client))["in_flight_requests"] == 0, "held before it reached the engine"
            await asyncio.to_thread(engine.continue_generation)
            return await asyncio.to_thread(engine.wait, 1, 300)

    try:
        [result] = asyncio.run(scenario())
    finally:
        engine.destroy()
    [(tokens, logprobs, _)] = outputs(result)
    assert tokens and len(logprobs) == len(tokens)


def test_the_engine_keeps_a_request_id_on_its_server_and_a_prompts_responses_together_while_in_flight() -> None:
    """samrollout's one stickiness rule (`samrollout_client.placement.StickyGroups`, as veRL's router): a
    request id AReaL sent before goes back to its server (a conversation's prefix cache) before its prompt's
    group; siblings with fresh ids follow the group while any is in flight; then the prompt is placed afresh."""
    engine = SamrolloutInfEngine(engine_config("sticky"))
    try:
        engine.addresses = servers = ["10.0.0.1:8000", "10.0.0.2:8000"]
        prompt = [5, 6, 7]
        home = engine._place(ModelRequest(rid="a", input_ids=prompt))
        assert home == servers[rendezvous_ranking(prompt_id(prompt), servers)[0]]
        assert engine._place(ModelRequest(rid="b", input_ids=prompt)) == home  # a sibling follows
        other = next(s for s in servers if s != home)
        engine.rid_to_address["turn"] = other  # an earlier turn of a conversation went to the other server
        assert engine._place(ModelRequest(rid="turn", input_ids=prompt)) == other
        assert engine.rid_to_address["turn"] == other
        for rid in ("a", "b", "turn"):
            engine._groups.release(rid)
        assert engine._groups.loads(servers) == [0, 0]
    finally:
        engine.destroy()


def test_a_server_killed_mid_rollout(areal_server: ServerProcess, areal_server_to_kill: ServerProcess,
                                     areal_names: None, tokenizer: Any) -> None:
    """A server dies with responses in flight: AReaL's own engine fails them after its retries (and a pause then
    fails: AReaL keeps the dead server); `SamrolloutEngine` drops the server, starts those responses again on the
    other one, and pauses and continues the servers left.  Before that, the group of 3 (3 requests to AReaL) all
    went to the prompt's server, where AReaL's round robin would have spread them."""
    servers = [areal_server, areal_server_to_kill]
    ours = start_engine(SamrolloutEngine, servers, trial="kill")
    stock = start_engine(RemotevLLMEngine, servers, trial="kill-stock")
    doomed = address(areal_server_to_kill)
    [text] = [text for text in (f"Tell me about the number {i}." for i in range(40))
              if rendezvous_ranking(prompt_id(prompt_ids(tokenizer, text)), [address(s) for s in servers])[0] == 1][:1]

    async def scenario() -> tuple[list[dict[str, Any]], BaseException | None]:
        async with httpx.AsyncClient(base_url=areal_server_to_kill.url, timeout=120) as client:
            await freeze(client)
            ours.submit(question(text), workflow=workflow(tokenizer, temperature=1.0, ignore_eos=True), group_size=3)
            await held_until_in_flight(client, 3, steps=2)
        areal_server_to_kill.kill()
        results = await asyncio.to_thread(ours.wait, 1, 300)
        request = ModelRequest(rid=uuid.uuid4().hex, input_ids=[1, 2, 3],
                               gconfig=GenerationHyperparameters(max_new_tokens=4))
        stock._engine.rid_to_address[request.rid] = doomed
        try:
            await stock.agenerate(request)
        except Exception as error:  # AReaL's engine: a RuntimeError once its retries are spent
            return results, error
        return results, None

    try:
        results, stock_error = asyncio.run(scenario())
        assert ours.dropped_servers == [doomed]
        with pytest.raises(RuntimeError):
            stock.pause_generation()  # it paused the live server, then failed on the dead one
        ours.pause_generation()
        ours.continue_generation()
    finally:
        ours.destroy()
        stock.destroy()
    assert isinstance(stock_error, RuntimeError)
    for trajectory in results:
        for tokens, _, versions in outputs(trajectory):
            assert len(tokens) == RESPONSE_TOKENS and versions == [0] * RESPONSE_TOKENS


def test_areal_routes_refuse_nccl_updates_and_bad_checkpoints(areal_server: ServerProcess) -> None:
    """AReaL's NCCL routes answer 501 naming the disk mode; an update from a missing directory (under the weights
    root: elsewhere it is a 403, tests/test_weight_access.py) is a 400 naming model_path, the served weights kept."""
    with httpx.Client(base_url=areal_server.url, timeout=60) as client:
        for route in ("/areal_init_weights_update_group", "/areal_set_update_weight_meta",
                      "/areal_update_weights_xccl"):
            reply = client.post(route, json={})
            assert reply.status_code == 501 and "weight_update_mode=disk" in reply.json()["error"]["message"]
        version = client.get("/health").json()["weight_version"]
        reply = client.post("/areal_update_weights", json={"model_path": str(CHECKPOINTS / "weight_update_v9")})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "model_path"
        assert client.get("/health").json()["weight_version"] == version


async def _none_in_flight(client: httpx.AsyncClient) -> bool:
    return int((await status(client))["in_flight_requests"]) == 0


async def _gate_holds(client: httpx.AsyncClient) -> bool:
    return int((await status(client))["areal"]["waiting_requests"]) >= 1


def _aborted(server: ServerProcess) -> float:
    """How many requests the server ended with ``finish_reason: "abort"`` (its finished-requests counter)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=60).text.splitlines():
        if line.startswith('samrollout_requests_finished_total{finish_reason="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _load_back(engine: RemotevLLMEngine, tiny_dir: Path, folder: Path, trial: str) -> None:
    """The original weights back as version 0 (for the module's other tests), through AReaL's update."""
    update_weights(engine, saved_checkpoint(tiny_dir, folder, 0), 0, trial)


def test_the_areal_example_prints_samples_with_their_versions(areal_server: ServerProcess, tiny_dir: Path,
                                                              checkpoints: Path) -> None:
    """examples/areal_async_grpo.py against the server: two steps, a weight update after each, every sample printed
    with the versions that sampled its tokens."""
    example = Path(__file__).resolve().parents[1] / "examples" / "areal_async_grpo.py"
    run = subprocess.run([sys.executable, str(example), "--servers", address(areal_server), "--tokenizer",
                          str(tiny_dir), "--weights", str(tiny_dir), "--checkpoint-dir", str(checkpoints),
                          "--steps", "2", "--groups", "2", "--n", "2",
                          "--max-new-tokens", "16", "--train-s", "0"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    samples = [line for line in run.stdout.splitlines() if line.startswith("  reward ")]
    assert len(samples) == 8 and all(re.search(r"\[(v\d+x\d+ ?)+\]", line) for line in samples), run.stdout
    assert "step 2:" in run.stdout and "weights v2 loaded on every server" in run.stdout


def test_areals_trainer_takes_its_vllm_engine_class_from_the_name_use_samrollout_engine_sets() -> None:
    """`use_samrollout_engine` rebinds ``areal.trainer.rl_trainer.RemotevLLMEngine``: the installed AReaL's trainer
    (not importable here: it needs its logging and tracking stack) imports that name at module level and builds its
    vLLM engine from it when it sets up the rollout, so the rebinding is what the trainer builds."""
    import ast

    import areal

    module = ast.parse((Path(areal.__file__).parent / "trainer" / "rl_trainer.py").read_text())
    imported = {alias.asname or alias.name for node in module.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert "RemotevLLMEngine" in imported, "rl_trainer no longer imports RemotevLLMEngine by name"
    assigned = [node for node in ast.walk(module) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "engine_cls" for t in node.targets)
                and isinstance(node.value, ast.Name) and node.value.id == "RemotevLLMEngine"]
    assert assigned, "rl_trainer no longer builds its vLLM engine from the module-level name RemotevLLMEngine"
    assert issubclass(SamrolloutEngine, RemotevLLMEngine)
