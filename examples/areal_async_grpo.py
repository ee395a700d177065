"""AReaL's asynchronous GRPO rollout side against samrollout servers, with a stub trainer.

    samrollout serve --areal-routes --weights-root /tmp/areal-checkpoints &   # wait for "startup complete"
    python examples/areal_async_grpo.py --steps 3 --checkpoint-dir /tmp/areal-checkpoints \
        --weights ~/.cache/samrollout/models/smollm2-135m-instruct

What runs is AReaL 1.0's own rollout code: its inference engine (``RemotevLLMEngine``, or
samrollout's `SamrolloutEngine` with ``--engine samrollout``, the default), its workflow
executor with bounded staleness (``--max-staleness``, AReaL's ``max_head_offpolicyness``), its
single-turn ``RLVRWorkflow`` (chat template, reward in a process pool, trajectory tensors) and
its disk weight update.  The trainer is a stub: each step it takes ``--groups`` GRPO groups
(``--n`` responses to one arithmetic question), computes the group-normalised advantages,
sleeps ``--train-s`` in place of a gradient step and, given ``--weights`` (a directory of
``*.safetensors`` with the served model's tensors, standing in for the trained weights), "saves"
them as AReaL's ``weight_update_v<N>`` under ``--checkpoint-dir`` (inside the servers'
``--weights-root``: they load nothing by path from elsewhere) and updates the servers exactly as
AReaL's FSDP engine does: pause, update from disk, continue, new version.  Responses generating meanwhile carry on;
each sample is printed with the weight versions that sampled its tokens (AReaL's per-token
``versions``), so a response that crossed an update shows two.

The servers are found as in AReaL's SPMD mode (``--servers``, AReaL's ``AREAL_LLM_SERVER_ADDRS``).
The tokenizer is the served model's (``--tokenizer``; default: the built-in model's directory).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from itertools import groupby
from pathlib import Path
from typing import Any

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.vllm_remote import RemotevLLMEngine
from areal.utils import name_resolve, names
from areal.workflow import RLVRWorkflow
from grpo_loop import advantages
from math_reward import correct
from transformers import AutoTokenizer

from samrollout_client.areal import SamrolloutEngine

EXPERIMENT, TRIAL = "samrollout-example", "areal-async-grpo"
BUILTIN_TOKENIZER = Path.home() / ".cache" / "samrollout" / "models" / "smollm2-135m-instruct"


def question(rng: random.Random) -> dict[str, Any]:
    """An arithmetic question as AReaL's chat data, with its answer (passed on to the reward)."""
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    op = rng.choice(["+", "-", "*"])
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return {"messages": [{"role": "user", "content": f"What is {a} {op} {b}? Give the number."}], "answer": answer}


def reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], answer: int,
           **_: Any) -> float:
    """1.0 if the response's final answer is the right one (`math_reward.final_answer`: "21 * 8 equals 168."
    answers 168), else 0.0 (AReaL calls it in a process pool: module level)."""
    return 1.0 if correct(completions, answer) else 0.0


def version_runs(versions: list[int]) -> str:
    """A response's per-token versions, run-length coded: ``v0x12 v1x20``."""
    return " ".join(f"v{version}x{len(list(run))}" for version, run in groupby(versions))


def link_or_copy(source: str, target: str) -> None:
    """A hard link where the file system allows one (no bytes copied), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def update_weights(engine: RemotevLLMEngine, weights: Path, folder: Path, version: int) -> float:
    """What AReaL's FSDP engine does after a step (``_update_weights_from_disk``), with ``weights`` as the saved
    checkpoint; the seconds generation was held."""
    held = time.monotonic()
    engine.pause()                                    # the trainer holds its executor (rollout.pause())
    engine.pause_generation()                         # the servers: pause
    path = folder / f"weight_update_v{version}"
    shutil.copytree(weights, path, copy_function=link_or_copy)  # "saved" (AReaL deletes it once loaded)
    meta = WeightUpdateMeta(type="disk", path=str(path))
    future = engine._engine.update_weights_from_disk(meta)  # waits for the trainer's "saved" record
    name_resolve.add(names.update_weights_from_disk(EXPERIMENT, TRIAL, engine.get_version()), str(time.time()),
                     replace=True)
    future.result()
    engine.continue_generation()
    engine.set_version(version)
    engine.resume()
    return time.monotonic() - held


def run(args: argparse.Namespace) -> None:
    """Keep the executor fed with groups, take a batch per step, "train", update the weights, print the samples."""
    rng = random.Random(args.seed)
    os.environ["AREAL_LLM_SERVER_ADDRS"] = args.servers
    workdir = Path(tempfile.mkdtemp(prefix="areal-example-"))
    checkpoints = Path(args.checkpoint_dir) if args.checkpoint_dir else workdir
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(workdir / "name_resolve")))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = InferenceEngineConfig(backend="vllm:d1", experiment_name=EXPERIMENT, trial_name=TRIAL,
                                   consumer_batch_size=args.groups, max_concurrent_rollouts=2 * args.groups,
                                   max_head_offpolicyness=args.max_staleness, request_timeout=600)
    engine = (SamrolloutEngine if args.engine == "samrollout" else RemotevLLMEngine)(config)
    engine.initialize()
    workflow = RLVRWorkflow(reward_fn=reward, tokenizer=tokenizer, gconfig=GenerationHyperparameters(
        max_new_tokens=args.max_new_tokens, temperature=1.0))
    try:
        for _ in range(2 * args.groups):
            engine.submit(question(rng), workflow=workflow, group_size=args.n)
        for step in range(1, args.steps + 1):
            started = time.monotonic()
            batch = engine.wait(args.groups, timeout=args.timeout)
            waited = time.monotonic() - started
            for _ in batch:  # keep the executor fed: the groups taken are replaced
                engine.submit(question(rng), workflow=workflow, group_size=args.n)
            print(f"step {step}: waited {waited:.1f} s for {len(batch)} groups (trainer at version "
                  f"{engine.get_version()})")
            for group in batch:
                rewards = group["rewards"].tolist()
                for row, advantage in enumerate(advantages(rewards)):
                    mask = group["loss_mask"][row].bool()
                    tokens = group["input_ids"][row][mask].tolist()
                    versions = group["versions"][row][mask].tolist()
                    text = tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " ")[:48]
                    print(f"  reward {rewards[row]:.0f} advantage {advantage:+.2f} {len(tokens):4d} tokens "
                          f"[{version_runs(versions)}] {text!r}")
            time.sleep(args.train_s)  # the gradient step
            if args.weights:
                held = update_weights(engine, Path(args.weights), checkpoints, step)
                print(f"  weights v{step} loaded on every server; generation held {held:.2f} s")
    finally:
        engine.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    """Parse the flags and run the loop."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="127.0.0.1:8000", help="host:port,... (AREAL_LLM_SERVER_ADDRS)")
    parser.add_argument("--engine", choices=["samrollout", "areal"], default="samrollout",
                        help="samrollout's engine (groups on one server, versions from the server) or AReaL's own")
    parser.add_argument("--tokenizer", default=str(BUILTIN_TOKENIZER), help="the served model's tokenizer")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4, help="groups per training batch")
    parser.add_argument("--n", type=int, default=4, help="responses per question (the GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-staleness", type=int, default=1, help="AReaL's max_head_offpolicyness")
    parser.add_argument("--train-s", type=float, default=1.0, help="the simulated gradient step")
    parser.add_argument("--weights", help="a directory of *.safetensors loaded after each step (none: no update)")
    parser.add_argument("--checkpoint-dir", help="where each step's checkpoint is saved: a directory inside the "
                        "servers' --weights-root (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a batch")
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
