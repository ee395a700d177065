"""Runs generation jobs on one real vLLM engine in its own process and writes the results as JSON.

    python tests/support/engine_jobs.py JOBS.json OUT.json

The tests start this once per engine configuration (vLLM wants its engine started under
``if __name__ == "__main__"`` and takes seconds to start), then compare runs.

The engine runs in this one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's engine core
and its one worker here, as vLLM's in-process client runs them), not in the three processes a
server uses, each of which imports vLLM (about 10 s each on this CPU): a run starts in about 20 s
instead of 45.  The model runner, the proposer, the scheduler and the rejection sampler are the
same code either way; the servers the other tests start keep vLLM's process layout.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function below
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core and worker in this process


def proposer_stats(worker: Any) -> dict[str, Any]:
    """The SAM proposer's counters and settings (run inside the worker), as `ProposerStats.to_json`."""
    result: dict[str, Any] = worker.model_runner.drafter.stats().to_json()
    return result


def _sample(output: Any) -> dict[str, Any]:
    logprobs = None
    if output.logprobs is not None:
        logprobs = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in output.logprobs]
    return {"token_ids": list(output.token_ids), "text": output.text, "finish_reason": output.finish_reason,
            "logprobs": logprobs}


def main() -> None:
    """Start the engine, run every job in order, dump outputs, spec-decode counters and drafter state."""
    from vllm import SamplingParams

    from samrollout.config import SpeculationConfig
    from samrollout.engine import build_llm

    with open(sys.argv[1], encoding="utf-8") as handle:
        spec = json.load(handle)
    speculation = SpeculationConfig.from_json(spec["speculation"]) if spec.get("speculation") else None
    llm = build_llm(spec["model"], speculation, **spec.get("engine", {}))
    results: dict[str, Any] = {}
    for job in spec["jobs"]:
        params: Any = SamplingParams(**job["params"])
        if "seeds" in job:  # one request per seed, the prompts cycled
            params = [SamplingParams(**job["params"], seed=seed) for seed in job["seeds"]]
            job["prompts"] = [job["prompts"][i % len(job["prompts"])] for i in range(len(params))]
        if job.get("chat"):
            outputs = llm.chat([[{"role": "user", "content": p}] for p in job["prompts"]], params, use_tqdm=False)
        elif "prompt_token_ids" in job:
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]], params,
                                   use_tqdm=False)
        else:
            outputs = llm.generate(job["prompts"], params, use_tqdm=False)
        results[job["name"]] = [[_sample(o) for o in out.outputs] for out in outputs]
    metrics = {m.name: m.value if getattr(m, "value", None) is not None else getattr(m, "values", None)
               for m in llm.get_metrics() if m.name.startswith(("vllm:spec_decode", "vllm:num_preemptions"))}
    proposer = llm.collective_rpc(proposer_stats)[0] if speculation else {}
    with open(sys.argv[2], "w", encoding="utf-8") as handle:
        json.dump({"results": results, "spec_metrics": metrics, "proposer": proposer}, handle)


if __name__ == "__main__":
    main()
