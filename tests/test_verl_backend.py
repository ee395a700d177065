"""samrollout as veRL's rollout backend, driven by veRL's own classes (Ray on CPU) against a real server.

What runs here is veRL 0.9's real code: its plugin discovery, `LLMServerManager` (which
builds our replicas and veRL's global load balancer), `AgentLoopManager` and its agent
loop workers (veRL's tokenizer handling, chat template and batch assembly), its
`LLMServerClient`, and its server-adapter registry for the weight sync.  What does not
run: veRL's FSDP/Megatron actor workers and a training step (they need a GPU model
engine); the weight-sync tests feed the adapter, or (for the fully-async trainer's
`CheckpointEngineManager`) our checkpoint engine, the ``(name, tensor)`` generator those
workers would.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("verl", reason="veRL is installed by `make install-dev`")

import ray
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import API_KEY, admin_status
from samrollout.testing import ServerProcess
from support.frozen_engine import counter, freeze, frozen, in_flight_at_least, step_until, until
from support.weight_swap import swapping_weights

RESPONSE_LENGTH = 24
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@pytest.fixture(scope="module")
def verl_server(second_tiny_server: ServerProcess, tiny_dir: Path) -> Iterator[ServerProcess]:
    """The session's second tiny server (the tests pause it and push weights to it), left as it was found."""
    with swapping_weights(second_tiny_server, "verl", tiny_dir, tiny_dir):
        yield second_tiny_server


def verl_config(url: str, model: Path) -> Any:
    """veRL's generated PPO trainer config with the rollout set to samrollout (what a user's overrides make)."""
    import verl

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "samrollout"
    rollout.nnodes, rollout.n_gpus_per_node, rollout.tensor_model_parallel_size = 1, 1, 1
    rollout.prompt_length, rollout.response_length = 64, RESPONSE_LENGTH
    rollout.calculate_log_probs = True
    rollout.n = 4
    rollout.agent.num_workers = 1
    rollout.custom = {"samrollout": {"urls": [url], "api_key": API_KEY}}
    config.actor_rollout_ref.model.path = str(model)
    config.trainer.n_gpus_per_node = 1
    return config


@pytest.fixture(scope="module")
def verl_run(verl_server: ServerProcess, tiny_dir: Path) -> Iterator[dict[str, Any]]:
    """A local Ray cluster, veRL's LLMServerManager over the server, and veRL's agent loop manager."""
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = verl_config(verl_server.url, tiny_dir)
        servers = LLMServerManager.create(config=config, worker_group=None)
        agent = AgentLoopManager.create(config=config, llm_client=servers.get_client())
        yield {"config": config, "servers": servers, "agent": agent, "client": servers.get_client()}
    finally:
        ray.shutdown()




def generate(run: dict[str, Any], prompt_ids: list[int], sampling: dict[str, Any]) -> Any:
    return run["client"].generate(uuid.uuid4().hex, prompt_ids=prompt_ids, sampling_params=dict(sampling))


def test_verl_finds_the_samrollout_backend_through_its_plugin_entry_point() -> None:
    code = ("import verl\n"
            "from verl.workers.rollout.replica import get_rollout_replica_class\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "print(get_rollout_replica_class('samrollout').__name__, get_rollout_class('samrollout').__name__)\n")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert found.stdout.split() == ["SamrolloutReplica", "SamrolloutServerAdapter"]


def test_a_grpo_batch_through_verls_agent_loop_has_verls_shapes_and_one_group_per_prompt(
        verl_run: dict[str, Any]) -> None:
    from verl import DataProto

    questions = ["What is 2+2?", "Name a colour.", "Count to three."]
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([[{"role": "user", "content": q}] for q in questions], dtype=object),
        "uid": np.array([uuid.uuid4().hex for _ in questions], dtype=object),
        "data_source": np.array(["test"] * len(questions), dtype=object),
        "reward_model": np.array([{"ground_truth": "4"}] * len(questions), dtype=object)})
    batch = batch.repeat(4, interleave=True)  # GRPO: n responses per prompt, as veRL's trainer repeats them
    batch.meta_info = {"global_steps": 0}
    out = verl_run["agent"].generate_sequences(batch)

    shapes = {key: tuple(value.shape) for key, value in out.batch.items()}
    assert shapes["responses"] == (12, RESPONSE_LENGTH) and shapes["prompts"] == (12, 64)
    assert shapes["input_ids"] == shapes["attention_mask"] == (12, 64 + RESPONSE_LENGTH)
    assert shapes["rollout_log_probs"] == (12, RESPONSE_LENGTH)
    mask = out.batch["response_mask"].bool()
    logprobs = out.batch["rollout_log_probs"][mask]
    assert mask.sum() > 0 and bool((logprobs <= 0).all()) and bool(logprobs.isfinite().all())
    groups: dict[str, set[str]] = {}
    for uid, group in zip(out.non_tensor_batch["uid"], out.non_tensor_batch["group_id"], strict=True):
        groups.setdefault(uid, set()).add(group)
    assert len(groups) == 3 and all(len(g) == 1 for g in groups.values())  # siblings share one group automaton
    assert len(set().union(*groups.values())) == 3


def test_logprobs_returned_to_verl_are_the_models_own(verl_run: dict[str, Any], verl_server: ServerProcess) -> None:
    prompt = [1, 504, 3458, 28, 253, 1345, 30]
    output = asyncio.run(generate(verl_run, prompt, GREEDY))
    assert output.stop_reason == "completed" and len(output.token_ids) == RESPONSE_LENGTH
    direct = httpx.post(f"{verl_server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": "tiny", "prompt": prompt, "max_tokens": RESPONSE_LENGTH, "temperature": 0,
                              "logprobs": 0}, timeout=120).json()
    assert output.token_ids == direct["choices"][0]["token_ids"]
    expected = direct["choices"][0]["logprobs"]["token_logprobs"]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(output.log_probs, expected, strict=True))


def test_abort_all_requests_ends_running_responses_and_holds_new_ones_until_resume(
        verl_run: dict[str, Any], verl_server: ServerProcess) -> None:
    replicas = verl_run["servers"].get_replicas()
    # Sampled responses (on CPU only greedy requests draft) of 400 tokens, sixteen through veRL beside 48 sent
    # straight to the server. They reach a frozen server (veRL's first calls may take seconds to arrive), which
    # then runs a step at a time until they have started and stays frozen, so the abort (through veRL's replicas)
    # lands mid-generation however slow or fast this machine: every one ends "aborted", short of its length.
    long = {**GREEDY, "temperature": 1.0, "max_tokens": 400, "ignore_eos": True}
    load = [{"model": "tiny", "prompt": [1, 7, i], "max_tokens": 400, "ignore_eos": True, "temperature": 1.0,
             "seed": i} for i in range(48)]

    async def scenario() -> tuple[list[Any], bool, Any]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=verl_server.url, timeout=300, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            generated = await counter(client)
            async with frozen(client):
                posts = [asyncio.create_task(client.post("/v1/completions", json=body)) for body in load]
                running = [asyncio.create_task(generate(verl_run, [1, 2, 3 + i], long)) for i in range(16)]
                await until(lambda: in_flight_at_least(client, 64), "the responses to reach the server", timeout=300)

                async def started() -> bool:
                    return await counter(client) >= generated + 64

                await step_until(client, started)  # frozen again: the abort lands mid-generation
                await asyncio.gather(*(r.abort_all_requests() for r in replicas))
                held = asyncio.create_task(generate(verl_run, [1, 9, 9], GREEDY))
                await asyncio.sleep(1.5)
                held_while_paused = not held.done()
                await asyncio.gather(*(r.resume_generation() for r in replicas))
            await asyncio.gather(*posts)
            return list(await asyncio.gather(*running)), held_while_paused, await held

    ended, held_while_paused, resumed = asyncio.run(scenario())
    assert all(o.stop_reason == "aborted" and len(o.token_ids) < 400 for o in ended)
    assert held_while_paused and resumed.stop_reason == "completed" and len(resumed.token_ids) == RESPONSE_LENGTH
    assert admin_status(verl_server)["paused"] is False


def test_abort_with_reject_request_answers_new_requests_aborted_at_once(
        verl_run: dict[str, Any], verl_server: ServerProcess) -> None:
    replicas = verl_run["servers"].get_replicas()

    async def scenario() -> Any:
        await asyncio.gather(*(r.abort_all_requests(reject_request=True) for r in replicas))
        try:
            return await asyncio.wait_for(generate(verl_run, [1, 5, 6], GREEDY), timeout=60)
        finally:
            await asyncio.gather(*(r.resume_generation() for r in replicas))

    rejected = asyncio.run(scenario())
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert asyncio.run(generate(verl_run, [1, 5, 6], GREEDY)).stop_reason == "completed"


def test_sleep_and_wake_leave_a_standalone_server_serving(verl_run: dict[str, Any]) -> None:
    replicas = verl_run["servers"].get_replicas()

    async def scenario() -> Any:
        await asyncio.gather(*(r.sleep() for r in replicas))
        await asyncio.gather(*(r.clear_kv_cache() for r in replicas))
        await asyncio.gather(*(r.wake_up() for r in replicas))
        return await generate(verl_run, [1, 7, 8], GREEDY)

    assert asyncio.run(scenario()).stop_reason == "completed"


def named_tensors(folder: Path, change: dict[str, Any] | None = None) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as veRL's actor yields them after a step, optionally with some replaced."""
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            yield name, (change or {}).get(name, tensor)


def test_weights_pushed_by_verls_adapter_change_outputs_and_global_steps(
        verl_run: dict[str, Any], verl_server: ServerProcess, tiny_dir: Path, tiny_weights_v2: Path) -> None:
    from verl.workers.rollout.base import get_rollout_class

    adapter = get_rollout_class("samrollout")(config=verl_run["config"].actor_rollout_ref.rollout, model_config=None)
    prompt = [1, 42, 43, 44, 45]
    before = asyncio.run(generate(verl_run, prompt, GREEDY))

    asyncio.run(adapter.update_weights(named_tensors(tiny_weights_v2), global_steps=7))
    pushed = asyncio.run(generate(verl_run, prompt, GREEDY))
    assert pushed.extra_fields["global_steps"] == 7 and admin_status(verl_server)["weight_version"] == "7"
    assert pushed.token_ids != before.token_ids
    assert adapter.last_push is not None and adapter.last_push.bytes > 0 and adapter.last_push.files

    asyncio.run(adapter.update_weights(named_tensors(tiny_dir), global_steps=8))
    restored = asyncio.run(generate(verl_run, prompt, GREEDY))
    assert restored.extra_fields["global_steps"] == 8 and restored.token_ids == before.token_ids


def test_a_tied_embedding_models_lm_head_is_not_pushed(verl_run: dict[str, Any], verl_server: ServerProcess,
                                                         tiny_dir: Path) -> None:
    """The trainer of a tied model yields lm_head.weight; its checkpoint (and so the server) has none."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    model_config = omega_conf_to_dataclass(verl_run["config"].actor_rollout_ref.model)
    adapter = get_rollout_class("samrollout")(config=verl_run["config"].actor_rollout_ref.rollout,
                                              model_config=model_config)
    embedding = dict(named_tensors(tiny_dir))["model.embed_tokens.weight"]
    with_head = [*named_tensors(tiny_dir), ("lm_head.weight", embedding)]
    asyncio.run(adapter.update_weights(iter(with_head), global_steps=9))
    assert admin_status(verl_server)["weight_version"] == "9" and adapter.skipped == {"lm_head.weight"}


def test_a_mismatched_weight_push_is_refused_and_the_old_weights_keep_serving(
        verl_run: dict[str, Any], verl_server: ServerProcess, tiny_dir: Path) -> None:
    from verl.workers.rollout.base import get_rollout_class

    from samrollout_client import SamrolloutError

    adapter = get_rollout_class("samrollout")(config=verl_run["config"].actor_rollout_ref.rollout, model_config=None)
    version = admin_status(verl_server)["weight_version"]
    name, tensor = next(named_tensors(tiny_dir))
    wrong_shape = {name: tensor[..., :-1].contiguous()}
    with pytest.raises(SamrolloutError, match="400"):
        asyncio.run(adapter.update_weights(named_tensors(tiny_dir, wrong_shape), global_steps=99))
    assert admin_status(verl_server)["weight_version"] == version
    assert asyncio.run(generate(verl_run, [1, 3, 5], GREEDY)).stop_reason == "completed"


def test_group_sticky_router_sends_a_prompts_responses_to_one_server() -> None:
    from samrollout_client.verl.router import GroupStickyLoadBalancer

    balancer = GroupStickyLoadBalancer({"a:1": "handle-a", "b:1": "handle-b"}, {"max_groups": 8})
    assert balancer.require_acquire_fields() == ["prompt_ids"]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    placed = {i: {balancer.acquire_server(uuid.uuid4().hex, prompt_ids=p)[0] for _ in range(4)}
              for i, p in enumerate(prompts)}
    assert all(len(servers) == 1 for servers in placed.values())  # siblings together
    assert {next(iter(s)) for s in placed.values()} == {"a:1", "b:1"}  # groups still spread (the load bound)
    assert balancer.clear_sticky_cache()["cleared_entries"] == 16


def test_the_verl_router_sends_a_prompt_to_the_same_server_every_step() -> None:
    """veRL's real balancer class underneath: siblings follow the first response, and after veRL clears its
    sticky caches between steps a prompt goes back to the server that holds its history."""
    from samrollout_client.placement import AFFINE_LOAD_FACTOR
    from samrollout_client.verl.router import GroupStickyLoadBalancer

    servers = {f"10.0.0.{i}:8000": f"handle-{i}" for i in range(4)}
    prompts = [[7, i, i + 1, 3 * i] for i in range(40)]

    def step(balancer: GroupStickyLoadBalancer) -> list[str]:
        homes = []
        for prompt in prompts:
            placed = {balancer.acquire_server(uuid.uuid4().hex, prompt_ids=prompt)[0] for _ in range(4)}
            assert len(placed) == 1  # siblings together
            homes.append(placed.pop())
        for server_id, count in balancer.get_status()["servers"].items():
            for _ in range(count):
                balancer.release_server(server_id)
        return homes

    balancer = GroupStickyLoadBalancer(servers, {"max_groups": 64})
    first = step(balancer)
    assert balancer.clear_sticky_cache()["cleared_entries"] == len(prompts) * 4
    assert step(balancer) == first  # the next step, after veRL cleared the caches
    assert step(GroupStickyLoadBalancer(servers, {"max_groups": 64})) == first  # a new router process
    assert set(first) == set(servers)
    share = len(prompts) * 4 / len(servers)  # the first response of a group is placed within the bound, then
    assert max(Counter(first).values()) * 4 <= math.ceil(AFFINE_LOAD_FACTOR * share) + 3  # its 3 siblings follow


def test_the_verl_router_keeps_a_conversation_on_its_server_and_lets_a_group_go_when_it_is_done() -> None:
    """samrollout's one stickiness rule (`samrollout_client.placement.StickyGroups`, as AReaL's engine): a request
    id veRL routed before (a later turn) goes back to its server; siblings follow their group while any is in
    flight; released (veRL passes the request id, which the router asks for), the group is placed afresh."""
    from samrollout_client.placement import rendezvous_ranking
    from samrollout_client.protocol.prompt_identity import prompt_id
    from samrollout_client.verl.router import GroupStickyLoadBalancer

    balancer = GroupStickyLoadBalancer({"a:1": "handle-a", "b:1": "handle-b"})
    assert balancer.require_release_fields() == ["request_id"]
    prompt = [1, 2, 3]
    home = balancer.acquire_server("conversation", prompt_ids=prompt)[0]
    assert balancer.acquire_server("sibling", prompt_ids=prompt)[0] == home
    balancer.release_server(home, request_id="conversation")
    servers = ["a:1", "b:1"]
    # its next turn: a longer prompt of its own, one whose affine server is the other one
    turns = ([*prompt, 4, i] for i in range(100))
    turn = next(t for t in turns if rendezvous_ranking(prompt_id(t), servers)[0] != servers.index(home))
    assert balancer.acquire_server("conversation", prompt_ids=turn)[0] == home
    for request_id in ("conversation", "sibling"):
        balancer.release_server(home, request_id=request_id)
    balancer._inflight_requests[home] = 100  # veRL's count: the prompt's server is past its load bound now
    assert balancer.acquire_server("late", prompt_ids=prompt)[0] != home  # the group was let go


def test_verl_loads_the_group_sticky_router_from_the_example_yaml(verl_run: dict[str, Any]) -> None:
    from verl.workers.rollout.llm_server import LLMServerManager

    config = OmegaConf.create(OmegaConf.to_container(verl_run["config"]))
    config.actor_rollout_ref.rollout.router_config_path = str(
        Path(__file__).resolve().parent.parent / "examples" / "verl_router.yaml")
    servers = LLMServerManager.create(config=config, worker_group=None)
    client = servers.get_client()
    assert ray.get(client._load_balancer.require_acquire_fields.remote()) == ["prompt_ids"]

    async def siblings() -> list[Any]:
        return list(await asyncio.gather(*(client.generate(uuid.uuid4().hex, prompt_ids=[1, 6, 6],
                                                           sampling_params=dict(GREEDY)) for _ in range(3))))

    outputs = asyncio.run(siblings())
    assert [o.stop_reason for o in outputs] == ["completed"] * 3
    assert len({o.extra_fields["group_id"] for o in outputs}) == 1


def test_the_backend_needs_server_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    from samrollout_client.verl.settings import URLS_ENV, backend_settings

    monkeypatch.delenv(URLS_ENV, raising=False)
    with pytest.raises(ValueError, match="no server URLs"):
        backend_settings(OmegaConf.create({"custom": None}))
    monkeypatch.setenv(URLS_ENV, "http://a:8000, http://b:8000/")
    assert backend_settings(OmegaConf.create({"custom": None})).urls == ("http://a:8000", "http://b:8000")
    with pytest.raises(ValueError, match="http://"):
        backend_settings({"custom": {"samrollout": {"urls": ["a:8000"]}}})


def test_a_prompt_with_no_room_to_generate_is_refused_before_it_reaches_the_server() -> None:
    from samrollout_client.verl.sampling import LengthBudget, completion_body

    budget = LengthBudget(prompt_length=64, response_length=24, max_model_len=32)
    with pytest.raises(ValueError, match="no room"):
        completion_body("tiny", list(range(1, 40)), {}, budget, rollout_id="r")
    body = completion_body("tiny", list(range(1, 20)), {"logprobs": True, "temperature": 0.5}, budget, rollout_id="r")
    assert body["max_tokens"] == 13 and body["logprobs"] == 0 and body["temperature"] == 0.5



def test_the_example_verl_command_composes_into_a_config_the_backend_reads(tmp_path: Path) -> None:
    """examples/verl_grpo_samrollout.sh, run with a `python3` that prints its arguments, through veRL's Hydra."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from samrollout_client.verl.settings import backend_settings

    shim = tmp_path / "python3"
    shim.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\n\' "$a"; done\n')
    shim.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "examples" / "verl_grpo_samrollout.sh"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path),
           "SAMROLLOUT_URLS": "http://rollout-0:8000,http://rollout-1:8000", "SAMROLLOUT_API_KEY": "k"}
    argv = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout.split("\n")
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose("ppo_trainer", overrides=[a for a in argv[2:] if a])
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    settings = backend_settings(rollout)
    assert rollout.name == "samrollout" and settings.urls == ("http://rollout-0:8000", "http://rollout-1:8000")
    assert settings.api_key == "k" and settings.in_flight == "abort"
    router = OmegaConf.load(config.actor_rollout_ref.rollout.router_config_path)
    assert router.router_class == "samrollout_client.verl.router.GroupStickyLoadBalancer"


def test_the_checkpoint_engine_builds_fresh_topologies_and_only_rank_0_pushes() -> None:
    """veRL mutates build_topology's dicts (it adds "method"); the non-master ranks only run the gathers."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from samrollout_client.verl.checkpoint_engine import SamrolloutCheckpointEngine

    assert CheckpointEngineRegistry.get("samrollout") is SamrolloutCheckpointEngine
    first = SamrolloutCheckpointEngine.build_topology(2, 1, [{}, {}, {}])
    first[0]["method"], first[1]["method"] = ["init_process_group"] * 2, ["init_process_group"]
    assert SamrolloutCheckpointEngine.build_topology(2, 1, [{}, {}, {}]) == ({}, {})

    engine = SamrolloutCheckpointEngine(bucket_size=1 << 20, is_master=False, urls=["http://127.0.0.1:9"])
    assert engine.settings.in_flight == "continue" and engine.prepare() == {}
    read: list[str] = []

    def weights() -> Iterator[tuple[str, Any]]:
        for i in range(5):
            read.append(f"w{i}")
            yield f"w{i}", np.zeros(3, dtype=np.float32)

    assert asyncio.run(engine.send_weights(weights(), global_steps=3)) == {} and engine.last_push is None
    assert read == [f"w{i}" for i in range(5)]  # every tensor gathered, nothing sent (the URL would refuse)
    tied = SamrolloutCheckpointEngine(is_master=True, urls=["http://a:1"], tie_word_embeddings=True, in_flight="wait")
    assert tied.skipped == {"lm_head.weight"} and tied.settings.in_flight == "wait"


SYNCED_LENGTH = 96  # tokens of each response that runs across veRL's weight sync


def test_verls_checkpoint_engine_manager_syncs_weights_to_running_servers_without_stopping_them(
        verl_run: dict[str, Any], verl_server: ServerProcess, tiny_server: ServerProcess, tiny_dir: Path) -> None:
    """veRL's fully-async weight sync (CheckpointEngineManager.update_weights, backend "samrollout") with our
    replicas; the trainer's rank 0 is a Ray actor feeding the engine the checkpoint's tensors, as veRL's actor
    worker does. Responses running meanwhile carry on and end with a span of the new version. The weights go to
    two servers (the replica's and `tiny_server`, weight peers of each other) and cross the trainer's link once."""
    with swapping_weights(tiny_server, "verl-sync", tiny_dir, tiny_dir):
        _sync_weights_while_responses_run(verl_run, verl_server, tiny_server, tiny_dir)


def _sync_weights_while_responses_run(verl_run: dict[str, Any], verl_server: ServerProcess,
                                      tiny_server: ServerProcess, tiny_dir: Path) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.rollout.llm_server import LLMServerManager

    engine_kwargs = {"urls": [verl_server.url, tiny_server.url], "api_key": API_KEY}

    class TrainerRank:  # veRL's actor worker, as far as the weight sync goes (defined here: Ray pickles it)
        def __init__(self, folder: str) -> None:
            from verl.checkpoint_engine.base import CheckpointEngineRegistry
            from verl.utils.import_utils import import_external_libs

            import_external_libs("samrollout_client.verl.checkpoint_engine")
            self.folder = folder
            self.engine = CheckpointEngineRegistry.new("samrollout", is_master=True, bucket_size=1 << 20,
                                                       **engine_kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
            def tensors() -> Iterator[tuple[str, Any]]:
                for file in sorted(Path(self.folder).glob("*.safetensors")):
                    yield from load_file(file).items()

            assert mode == "samrollout"
            return await self.engine.send_weights(tensors(), global_steps=global_steps)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.engine, method)(*args, **kwargs)

    trainer_cls: Any = ray.remote(num_cpus=0)(TrainerRank)
    rank0 = trainer_cls.remote(str(tiny_dir))
    actor_wg = RayWorkerGroup(worker_handles=[rank0], ray_cls_with_init=RayClassWithInitArgs(cls=trainer_cls))
    assert ray.get(actor_wg.execute_checkpoint_engine(["prepare"])) == [{}]

    config = OmegaConf.create(OmegaConf.to_container(verl_run["config"]))
    config.actor_rollout_ref.rollout.custom.samrollout.in_flight = "continue"
    servers = LLMServerManager.create(config=config, worker_group=None)
    replicas, client = servers.get_replicas(), servers.get_client()
    assert all(len(r.workers) == 1 for r in replicas)
    manager = CheckpointEngineManager(
        config=CheckpointEngineConfig(backend="samrollout", engine_kwargs={"samrollout": engine_kwargs},
                                      custom_backend_module="samrollout_client.verl.checkpoint_engine"),
        actor_wg=actor_wg, replicas=replicas)
    # Long enough to run on after the sync, which lands a step or two in (the engine is frozen until it does).
    long = {**GREEDY, "temperature": 1.0, "max_tokens": SYNCED_LENGTH, "ignore_eos": True}
    pushed = manager.update_weights(global_steps=10)  # idle servers (auto_await)
    assert pushed["samrollout/weight_push_bytes"] > 0
    assert pushed["samrollout/weight_push_bytes_sent"] == pushed["samrollout/weight_push_bytes"]  # relayed
    assert admin_status(verl_server)["weight_version"] == "10" == admin_status(tiny_server)["weight_version"]

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        # The responses reach a frozen server ("keep" ends nothing; they wait in the engine), which then runs a
        # step at a time until they have tokens and stays frozen: the sync lands a few steps into them however slow
        # veRL's dispatch is (left running, they all ended first on a loaded CI machine).
        async with httpx.AsyncClient(base_url=verl_server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            generated = await counter(http)
            await freeze(http)
            running = [asyncio.create_task(client.generate(uuid.uuid4().hex, prompt_ids=[1, 4, 5 + i],
                                                           sampling_params=dict(long))) for i in range(24)]
            await until(lambda: in_flight_at_least(http, 24), "the responses to reach the server", timeout=300)

            async def started() -> bool:
                return await counter(http) >= generated + 24

            await step_until(http, started)
        metrics = await manager.update_weights(global_steps=11)  # the "continue" update resumes the engine
        return list(await asyncio.gather(*running)), metrics

    ended, metrics = asyncio.run(scenario())
    assert admin_status(verl_server)["weight_version"] == "11" and admin_status(verl_server)["paused"] is False
    assert metrics["samrollout/weight_push_bytes"] > 0
    assert all(o.stop_reason == "completed" and len(o.token_ids) == SYNCED_LENGTH for o in ended)  # nothing aborted
    versions = [(o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) for o in ended]
    across = [(low, high) for low, high in versions if low != high]
    assert across, "no response ran across the update"  # its first tokens by the old weights, its last by 11
    assert all((low, high) == (10, 11) for low, high in across)
    assert all(o.extra_fields["global_steps"] == high for o, (_, high) in zip(ended, versions, strict=True))
    after = asyncio.run(client.generate(uuid.uuid4().hex, prompt_ids=[1, 4, 4], sampling_params=dict(GREEDY)))
    assert after.extra_fields["global_steps"] == 11
