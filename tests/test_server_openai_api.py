"""The OpenAI API of `samrollout serve`, driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from conftest import API_KEY
from samrollout.testing import ServerProcess

MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: ServerProcess, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120, **kwargs)


def test_openai_client_completion_returns_text_token_ids_and_weight_version(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=12, temperature=0)
    choice = reply.choices[0]
    extra = choice.model_extra or {}
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert len(extra["token_ids"]) == 12 and extra["prompt_token_ids"]
    assert choice.text and (reply.model_extra or {})["weight_version"]


def test_batched_prompts_get_one_choice_each_in_prompt_order(client: openai.OpenAI) -> None:
    prompts = ["one", "two two", "three three three"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    assert [c.text for c in reply.choices] == alone


def test_token_id_prompt_is_accepted_and_echoed_in_prompt_token_ids(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=3, temperature=0)
    assert (reply.choices[0].model_extra or {})["prompt_token_ids"] == [1, 2, 3, 4, 5]


def test_n_samples_return_n_choices_with_group_and_rollout_ids(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, n=4, temperature=1.0, seed=7,
                                      extra_body={"rollout_id": "r-n", "group_id": "g-n"})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    extra = reply.model_extra or {}
    assert extra["rollout_id"] == "r-n" and extra["group_id"] == "g-n"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt="Random:", max_tokens=16, temperature=1.0, seed=seed)
        return reply.choices[0].text

    assert sample(123) == sample(123)
    assert len({sample(s) for s in range(5)}) > 1


def test_logprobs_are_returned_for_each_generated_token(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=6, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == 6 and all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs if top)


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    assert reply.choices[0].text.startswith("Echo me")


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=20, temperature=0).choices[0].text
    stop = free.strip().split()[1] if len(free.split()) > 1 else free[2:5]
    reply = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=20, temperature=0, stop=[stop])
    assert reply.choices[0].finish_reason == "stop" and stop not in reply.choices[0].text


def test_streaming_sends_chunks_that_add_up_to_the_full_text(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Stream:", max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Stream:", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"rollout_id": "r-stream"}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all((c.model_extra or {}).get("rollout_id") == "r-stream" for c in chunks)
    assert all((c.model_extra or {}).get("weight_version") for c in chunks)


def test_chat_completion_uses_the_chat_template(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=5, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content is not None
    prompt_ids = (reply.choices[0].model_extra or {}).get("prompt_token_ids") or (reply.model_extra or {}).get(
        "prompt_token_ids")
    assert prompt_ids and len(prompt_ids) > 3  # template tokens around the one-word message


def test_chat_streaming_works(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health_and_metrics_answer_without_a_key(tiny_server: ServerProcess) -> None:
    health = httpx.get(f"{tiny_server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(f"{tiny_server.url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text


def test_raw_http_stream_is_server_sent_events_ending_in_done(tiny_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "SSE", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"
