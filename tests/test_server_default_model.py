"""`samrollout serve` as the README starts it: the built-in SmolLM2, SAM on; then a graceful SIGTERM."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from conftest import server_fixture
from samrollout.testing import ServerProcess


def default_server_args(tiny_dir: Path) -> list[str]:
    """No flags: the default (the built-in SmolLM2, SAM on)."""
    return []


default_server = server_fixture("default_server", default_server_args)


def test_readme_command_serves_the_builtin_model_to_the_openai_client(default_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    reply = client.completions.create(model="smollm2-135m-instruct", prompt="2 + 2 =", max_tokens=8, temperature=0)
    assert reply.choices[0].text.strip()
    chat = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert (chat.choices[0].message.content or "").strip()
    prompt_ids = (chat.model_extra or {}).get("prompt_token_ids") or []
    assert prompt_ids[0] == 1 and prompt_ids.count(1) >= 2  # <|im_start|> opens each templated turn


def test_sigterm_lets_in_flight_requests_finish_and_exits_cleanly(default_server: ServerProcess) -> None:
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": "Write a long story.", "max_tokens": 64,
                "temperature": 0, "ignore_eos": True}
        result["reply"] = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=300)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 120
    while httpx.get(f"{default_server.url}/admin/status", params={"drafter": "false"},
                    timeout=30).json()["in_flight_requests"] < 1:  # in flight before the SIGTERM, however slow
        assert time.monotonic() < deadline and worker.is_alive(), "the request never reached the server"
        time.sleep(0.05)
    code = default_server.stop(timeout=120)
    worker.join(timeout=60)
    reply = result["reply"]
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 64
    assert code == 0, default_server.log_tail()
