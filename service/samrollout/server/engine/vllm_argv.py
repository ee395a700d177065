"""The server's settings as vLLM's own server flags: the one place that translates `ServerSettings` for vLLM."""

from __future__ import annotations

import json

from samrollout.config import ADDITIONAL_CONFIG_KEY, DeviceKind
from samrollout.cpu_defaults import cpu_dtype
from samrollout.engine import vllm_speculative_config
from samrollout.server.settings import ServerSettings
from samrollout.spec_decode.worker_extension import WORKER_EXTENSION_CLASS


def vllm_argv(settings: ServerSettings, model_path: str, device: DeviceKind,
              per_request_metrics_flags: bool = True) -> list[str]:
    """vLLM server flags for ``settings`` (parsed by vLLM's own argument parser).

    ``per_request_metrics_flags``: whether the installed vLLM has the per-request metrics
    flags (0.32 does, 0.23 does not: then `per_request_metrics` passes nothing).
    ``device``: what the engine runs on (memory, dtype, and the draft range's and the critical path's "auto").
    """
    on_cpu = device == "cpu"
    memory = settings.gpu_memory_utilization or (0.3 if on_cpu else 0.9)
    speculation = settings.speculation_config(device)
    argv = ["--model", model_path, "--served-model-name", settings.public_model_name(model_path),
            "--seed", str(settings.seed), "--dtype", cpu_dtype(settings.dtype) if on_cpu else settings.dtype,
            "--tensor-parallel-size", str(settings.tensor_parallel_size),
            "--gpu-memory-utilization", str(memory),
            "--worker-extension-cls", WORKER_EXTENSION_CLASS]
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if not settings.chunked_prefill:
        argv.append("--no-enable-chunked-prefill")
    if settings.compile is False or (settings.compile is None and on_cpu):
        argv.append("--enforce-eager")
    if settings.per_request_metrics and per_request_metrics_flags:
        argv.append("--enable-per-request-metrics")
        if speculation is not None:
            argv += ["--per-request-spec-decode-metrics", "summary"]
    if settings.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(settings.max_num_seqs)]
    if speculation is not None:
        argv += ["--speculative-config", json.dumps(vllm_speculative_config(speculation)),
                 "--additional-config", json.dumps({ADDITIONAL_CONFIG_KEY: speculation.to_json()})]
    return argv + list(settings.vllm_args)
