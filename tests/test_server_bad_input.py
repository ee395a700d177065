"""Bad input gets an OpenAI-style 4xx error, and the server keeps serving; a schema fuzz finds no 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from conftest import API_KEY, TINY_CONTEXT, TINY_MAX_PROMPT_TOKENS
from samrollout.testing import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = "hello " * 600  # more tokens than the test server's 512-token context

BAD_COMPLETIONS: list[tuple[str, Any, int, str | None]] = [
    ("malformed JSON", b"{bad json", 400, None),
    ("not an object", [1, 2], 400, None),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens of the wrong type", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("n above the server limit", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("negative temperature", {"prompt": "hi", "temperature": -3}, 400, None),
    ("top_p out of range", {"prompt": "hi", "top_p": 7}, 400, None),
    ("prompt longer than the context", {"prompt": LONG_PROMPT, "max_tokens": 5}, 400, None),
    ("max_tokens beyond the context", {"prompt": "hi", "max_tokens": 5000}, 400, None),
    ("token id outside the vocabulary", {"prompt": [1, 2, 99_999_999]}, 400, "prompt"),
    ("negative token id", {"prompt": [1, -5]}, 400, None),
    ("unknown model", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("rollout id with spaces", {"prompt": "hi", "rollout_id": "bad id!"}, 400, "rollout_id"),
    ("missing prompt", {"max_tokens": 3}, 400, None),
    # vLLM's beam score divides by length ** length_penalty: 0.0 for a penalty this large (the schema fuzz's find)
    ("beam search length penalty out of range",
     {"prompt": "hi", "max_tokens": 4, "use_beam_search": True, "length_penalty": -2.9e16}, 400, "length_penalty"),
]


@pytest.mark.parametrize(("case", "body", "status", "param"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_request_gets_openai_error_with_4xx(tiny_server: ServerProcess, case: str, body: Any,
                                                           status: int, param: str | None) -> None:
    if isinstance(body, dict):
        body = {"model": "tiny", **body}
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    reply = httpx.post(f"{tiny_server.url}/v1/completions", content=content, timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def _post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": "tiny", "temperature": 0, **body}, headers=AUTH,
                      timeout=120)


def _refused(reply: httpx.Response, param: str, *says: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and all(s in error["message"] for s in says), error


def test_token_prompt_plus_max_tokens_one_over_the_context_is_refused(tiny_server: ServerProcess) -> None:
    prompt = [1000 + i % 50 for i in range(470)]
    fits = _post(tiny_server, "completions", {"prompt": prompt, "max_tokens": TINY_CONTEXT - 470, "ignore_eos": True})
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"][0]["token_ids"]) == TINY_CONTEXT - 470  # all of it, not clamped
    over = _post(tiny_server, "completions", {"prompt": prompt, "max_tokens": TINY_CONTEXT - 469})
    _refused(over, "max_tokens", f"maximum context length is {TINY_CONTEXT}", "470 tokens",
             f"{TINY_CONTEXT + 1} in all")


def test_text_prompt_plus_max_tokens_over_the_context_is_refused(tiny_server: ServerProcess) -> None:
    prompt = "hello " * 460
    first = _post(tiny_server, "completions", {"prompt": prompt, "max_tokens": 1})
    assert first.status_code == 200, first.text
    length = len(first.json()["choices"][0]["prompt_token_ids"])  # as vLLM tokenized it
    assert 400 < length <= TINY_MAX_PROMPT_TOKENS
    fits = _post(tiny_server, "completions", {"prompt": prompt, "max_tokens": TINY_CONTEXT - length})
    assert fits.status_code == 200, fits.text
    over = _post(tiny_server, "completions", {"prompt": prompt, "max_tokens": TINY_CONTEXT - length + 1})
    _refused(over, "max_tokens", f"{length} tokens", f"{TINY_CONTEXT + 1} in all")


def test_chat_prompt_plus_max_tokens_over_the_context_is_refused(tiny_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "hello " * 400}]
    first = _post(tiny_server, "chat/completions", {"messages": messages, "max_tokens": 1})
    assert first.status_code == 200, first.text
    length = len(first.json()["prompt_token_ids"])  # the rendered chat template
    over = _post(tiny_server, "chat/completions", {"messages": messages, "max_tokens": TINY_CONTEXT - length + 1})
    _refused(over, "max_tokens", f"{TINY_CONTEXT + 1} in all")
    over = _post(tiny_server, "chat/completions",
                 {"messages": messages, "max_completion_tokens": TINY_CONTEXT - length + 1})
    _refused(over, "max_completion_tokens", f"{TINY_CONTEXT + 1} in all")
    fits = _post(tiny_server, "chat/completions", {"messages": messages, "max_tokens": TINY_CONTEXT - length})
    assert fits.status_code == 200, fits.text


def test_prompts_over_max_prompt_tokens_are_refused_naming_the_limit(tiny_server: ServerProcess) -> None:
    limit = TINY_MAX_PROMPT_TOKENS
    at_limit = _post(tiny_server, "completions", {"prompt": [7] * limit, "max_tokens": TINY_CONTEXT - limit})
    assert at_limit.status_code == 200, at_limit.text
    tokens = _post(tiny_server, "completions", {"prompt": [7] * (limit + 1), "max_tokens": 1})
    _refused(tokens, "prompt", f"{limit + 1} tokens", f"limit of {limit} (--max-prompt-tokens)")
    text = _post(tiny_server, "completions", {"prompt": "hello " * (limit + 10), "max_tokens": 1})
    _refused(text, "prompt", f"limit of {limit} (--max-prompt-tokens)")
    batch = _post(tiny_server, "completions", {"prompt": ["short", "hello " * (limit + 10)], "max_tokens": 1})
    _refused(batch, "prompt", "--max-prompt-tokens")
    one = _post(tiny_server, "chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1})
    template = len(one.json()["prompt_token_ids"]) - 1  # what the chat template adds to one word
    content = "hello " * (limit + 5 - template)  # rendered: just over the limit, inside the context
    chat = _post(tiny_server, "chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    _refused(chat, "messages", f"limit of {limit} (--max-prompt-tokens)")


def test_a_chat_beam_search_length_penalty_out_of_range_is_refused_and_one_in_range_is_served(
        tiny_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for penalty in (-2.9e16, 11):
        reply = _post(tiny_server, "chat/completions", {"messages": messages, "max_tokens": 4, "use_beam_search": True,
                                                        "length_penalty": penalty})
        _refused(reply, "length_penalty")
    served = _post(tiny_server, "chat/completions", {"messages": messages, "max_tokens": 4, "use_beam_search": True,
                                                     "n": 2, "length_penalty": -10})
    assert served.status_code == 200, served.text


def test_more_prompts_than_max_prompts_in_one_request_are_refused(tiny_server: ServerProcess) -> None:
    reply = _post(tiny_server, "completions", {"prompt": [f"p{i}" for i in range(257)], "max_tokens": 1})
    _refused(reply, "prompt", "at most 256 prompts", "--max-prompts", "got 257")
    tokens = _post(tiny_server, "completions", {"prompt": [[1, 2]] * 257, "max_tokens": 1})
    _refused(tokens, "prompt", "at most 256 prompts")


def test_wrong_content_type_is_rejected(tiny_server: ServerProcess) -> None:
    reply = httpx.post(f"{tiny_server.url}/v1/completions", content=b"prompt=hi", timeout=30,
                       headers={**AUTH, "content-type": "application/x-www-form-urlencoded"})
    assert reply.status_code == 400 and "error" in reply.json()


def test_missing_or_wrong_api_key_is_401_on_v1_and_admin(tiny_server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/admin/status")):
            reply = httpx.request(method, f"{tiny_server.url}{path}", json={"model": "tiny", "prompt": "x"},
                                  headers=headers, timeout=30)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "AuthenticationError"


def test_server_still_serves_after_bad_requests(tiny_server: ServerProcess) -> None:
    for _, body, _, _ in BAD_COMPLETIONS:
        httpx.post(f"{tiny_server.url}/v1/completions", json=body if not isinstance(body, bytes) else None,
                   headers=AUTH, timeout=60)
    reply = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": "tiny", "prompt": "still here", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_schema_fuzz_of_the_generation_routes_finds_no_server_error(tiny_server: ServerProcess) -> None:
    """schemathesis generates requests from the server's own OpenAPI schema; none may get a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json", headers=AUTH)  # docs need the key
    fuzzed = schema.include(path_regex=r"^/(v1/.*|health|admin/(status|abort_rollout|reset_prefix_cache))$")
    failures: list[str] = []
    calls: list[str] = []

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        body = case.body
        if isinstance(body, dict):  # keep generation short (validation paths are what is fuzzed): without a
            for field in ("max_tokens", "max_completion_tokens"):  # limit, a reply runs to the end of the context
                if isinstance(body.get(field), int) and body[field] > 16:
                    body[field] = 16
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = 16
        reply = case.call(base_url=tiny_server.url, headers=AUTH, timeout=120)
        calls.append(case.path)
        if reply.status_code >= 500:
            sent = json.dumps(case.body, default=str)[:1000]  # the input, so a rare failure can be replayed
            failures.append(f"{case.method} {case.path} {sent} -> {reply.status_code}: {reply.text[:300]}")

    for operation in fuzzed.get_all_operations():
        given(operation.ok().as_strategy())(check)()
    assert not failures, "\n".join(failures[:10])
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(calls)
    assert calls.count("/v1/completions") >= 20 and calls.count("/v1/chat/completions") >= 20
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
