"""Shared fixtures: the built-in models (converted once, cached) and a runner for real engine jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from samrollout.models import build_tiny_model, cache_root, ensure_smollm2

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


def run_engine_jobs(model: Path, speculation: dict[str, Any] | None, jobs: list[dict[str, Any]],
                    workdir: Path, **engine: Any) -> dict[str, Any]:
    """Run ``jobs`` on a fresh engine in a subprocess (tests/support/engine_jobs.py) and return its JSON."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file, out_file = workdir / "jobs.json", workdir / "out.json"
    spec_file.write_text(json.dumps({"model": str(model), "speculation": speculation,
                                     "engine": {**ENGINE, **engine}, "jobs": jobs}))
    proc = subprocess.run([sys.executable, str(HERE / "support" / "engine_jobs.py"), str(spec_file), str(out_file)],
                          capture_output=True, text=True, timeout=900, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"engine jobs failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(out_file.read_text())
    return result


# --- the HTTP server, started once per test session (samrollout.testing) ---
API_KEY = "test-key"
# Fraction of this machine's memory each tiny-model server reserves (KV cache); several run at once.
TINY_SERVER_MEMORY = 0.1
TINY_CONTEXT = 512            # the tiny server's --max-model-len
TINY_MAX_PROMPT_TOKENS = 480  # the tiny server's --max-prompt-tokens
TINY_CHUNK_TOKENS = 128       # the tiny server's prefill chunk (vLLM's --max-num-batched-tokens)


@pytest.fixture(scope="session")
def tiny_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """`samrollout serve` on the tiny model, SAM on, an API key set; stopped with SIGTERM at the end.

    Limits: a 512-token context, n <= 16, prompts of at most 480 tokens (TINY_MAX_PROMPT_TOKENS).
    """
    from samrollout.testing import start_server

    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    server = start_server(["--model", str(tiny_dir), "--served-model-name", "tiny", "--api-key", API_KEY,
                           "--max-model-len", str(TINY_CONTEXT), "--max-prompt-tokens", str(TINY_MAX_PROMPT_TOKENS),
                           "--max-n", "16", "--dtype", "float32",
                           "--gpu-memory-utilization", str(TINY_SERVER_MEMORY),
                           "--threshold-mode", "static",
                           # small prefill chunks: long prompts (and seeded ones) are prefilled over several steps
                           "--", "--max-num-batched-tokens", str(TINY_CHUNK_TOKENS)], log)
    yield server
    server.stop()


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
