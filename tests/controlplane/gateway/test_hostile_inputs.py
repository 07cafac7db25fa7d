"""Hostile inputs through the real ASGI application: every one is a 400 (or 404, 405, 408) in the
protocol's shape that names the field, before any engine work. No worker needed."""

import asyncio
import json

import pytest

from recipe.api import RequestLimits
from tests.controlplane.gateway.helpers import (
    ALL_PROTOCOLS,
    GENERATION_PROTOCOLS,
    PATHS,
    assert_error,
    key_headers,
    valid_body,
)
from workers.protocol.messages import WorkerHeartbeat

PROMPT_FIELDS = {
    "chat.completions": "messages",
    "completions": "prompt",
    "responses": "input",
    "messages": "messages",
    "messages.count_tokens": "messages",
}
TOKEN_COUNT_FIELDS = {"chat.completions": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}


def assert_refused(response, protocol: str, field: str, *, exact: bool = True) -> None:
    """A 400 in the protocol's shape that names `field` (OpenAI: in `param`; Anthropic: in the message)."""
    error = assert_error(response, protocol, 400, "invalid_request_error")
    if protocol.startswith("messages"):
        assert f"`{field}" in error["message"], error
    elif exact:
        assert error["param"] == field, error
    else:
        assert error["param"].startswith(field), error


def post_raw(api, protocol: str, content: bytes, key: str):
    headers = {**key_headers(key), "content-type": "application/json"}
    return api.request("POST", PATHS[protocol], content=content, headers=headers)


def with_prompt(protocol: str, text_json: str) -> bytes:
    """The protocol's valid body as raw JSON, with its prompt text replaced by `text_json` (JSON text)."""
    body = valid_body(protocol)
    marker = "PROMPT-MARKER"
    if protocol == "completions":
        body["prompt"] = marker
    elif protocol == "responses":
        body["input"] = marker
    else:
        body["messages"] = [{"role": "user", "content": marker}]
    return json.dumps(body).replace(f'"{marker}"', text_json).encode()


def prompt_field(protocol: str) -> str:
    return {"completions": "prompt", "responses": "input"}.get(protocol, "messages[0].content")


@pytest.fixture
def key(make_api_key) -> str:
    return make_api_key()


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_a_lone_surrogate_escape_in_the_raw_body_is_refused(api, key, protocol):
    response = post_raw(api, protocol, with_prompt(protocol, '"hello \\ud800 world"'), key)

    assert_refused(response, protocol, prompt_field(protocol))


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
@pytest.mark.parametrize("raw", [b'"caf\xe9"', b'"\xff\xfe"', b'"\xed\xa0\x80"', b'"\xc0\xaf"'])
def test_invalid_utf8_bytes_in_a_string_are_refused_naming_it(api, key, protocol, raw):
    content = with_prompt(protocol, "RAW").replace(b"RAW", raw)

    assert_refused(post_raw(api, protocol, content, key), protocol, prompt_field(protocol))


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_invalid_utf8_outside_strings_and_non_json_numbers_are_refused(api, key, protocol):
    for content in [b'{"model": \xff}', b'{"model": "smollm2-135m-instruct", "temperature": NaN}', b'{"a": Infinity}']:
        assert_error(post_raw(api, protocol, content, key), protocol, 400, "invalid_request_error")


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
@pytest.mark.parametrize("value", ["1" + "0" * 30, "-" + "1" * 25, "1e400"])
def test_numbers_past_64_bits_or_past_floats_are_refused(api, key, protocol, value):
    content = json.dumps(valid_body(protocol, metadata={"n": "NUMBER"})).replace('"NUMBER"', value).encode()

    assert_refused(post_raw(api, protocol, content, key), protocol, "metadata.n")


@pytest.mark.parametrize("protocol", GENERATION_PROTOCOLS)
def test_giant_token_counts_are_refused(api, key, protocol):
    field = TOKEN_COUNT_FIELDS.get(protocol, "max_tokens")

    for value in [10**30, 2**63, 10**9]:
        assert_refused(
            api.post(protocol, valid_body(protocol, **{field: value}), headers=key_headers(key)), protocol, field
        )


@pytest.mark.parametrize("protocol", GENERATION_PROTOCOLS)
@pytest.mark.parametrize("value", [-1, 10**20])
def test_negative_or_giant_top_k_is_refused(api, key, protocol, value):
    assert_refused(api.post(protocol, valid_body(protocol, top_k=value), headers=key_headers(key)), protocol, "top_k")


@pytest.mark.parametrize("protocol", ["chat.completions", "completions"])
def test_seeds_past_64_bits_are_refused(api, key, protocol):
    assert_refused(api.post(protocol, valid_body(protocol, seed=2**70), headers=key_headers(key)), protocol, "seed")


@pytest.mark.parametrize("protocol", ["chat.completions", "completions"])
@pytest.mark.parametrize("digit", ["²", "١", "٣"])
def test_a_unicode_digit_logit_bias_key_is_refused(api, key, protocol, digit):
    response = api.post(protocol, valid_body(protocol, logit_bias={digit: 5}), headers=key_headers(key))

    assert_refused(response, protocol, "logit_bias")


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_content_nested_900_deep_is_refused(api, key, protocol):
    nested: object = "hi"
    for _ in range(900):
        nested = [nested]
    prompt = {"prompt": nested} if protocol == "completions" else {}
    if protocol == "responses":
        prompt = {"input": [{"role": "user", "content": nested}]}
    elif protocol != "completions":
        prompt = {"messages": [{"role": "user", "content": nested}]}

    response = api.post(protocol, valid_body(protocol, **prompt), headers=key_headers(key))

    assert_refused(response, protocol, PROMPT_FIELDS[protocol], exact=False)


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_a_body_nested_past_what_the_parser_holds_is_refused_as_a_whole(api, key, protocol):
    content = with_prompt(protocol, "1").replace(b"}", b', "deep": ' + b"[" * 5000 + b"]" * 5000 + b"}", 1)

    error = assert_error(post_raw(api, protocol, content, key), protocol, 400, "invalid_request_error")

    assert "too deep" in error["message"]


@pytest.mark.parametrize("protocol", ["chat.completions", "responses", "messages", "messages.count_tokens"])
def test_a_tool_schema_nested_200_deep_is_refused(api, key, protocol):
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = {
        "chat.completions": {"type": "function", "function": {"name": "f", "parameters": schema}},
        "responses": {"type": "function", "name": "f", "parameters": schema},
    }.get(protocol, {"name": "f", "input_schema": schema})

    response = api.post(protocol, valid_body(protocol, tools=[tools]), headers=key_headers(key))

    assert_refused(response, protocol, "tools[0]", exact=False)


def test_messages_without_max_tokens_is_refused_and_count_tokens_is_not(api, key):
    body = valid_body("messages")
    del body["max_tokens"]

    assert_refused(api.post("messages", body, headers=key_headers(key)), "messages", "max_tokens")
    assert api.post("messages.count_tokens", body, headers=key_headers(key)).json()["input_tokens"] > 0


@pytest.mark.parametrize("protocol", ["chat.completions", "responses", "messages", "messages.count_tokens"])
def test_the_limits_come_from_the_settings(api, key, settings, protocol):
    settings.SLUICE_REQUEST_LIMITS = RequestLimits(max_messages=1)
    field = PROMPT_FIELDS[protocol]
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    assert_refused(api.post(protocol, valid_body(protocol, **{field: two}), headers=key_headers(key)), protocol, field)


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_a_wrong_method_is_405_in_the_protocols_shape(api, key, protocol):
    for method in ["GET", "PUT", "DELETE", "OPTIONS"]:
        response = api.request(method, PATHS[protocol], headers=key_headers(key))
        assert_error(response, protocol, 405, "invalid_request_error")
        assert response.headers["allow"] == "POST"


def test_posting_to_models_is_405(api, key):
    response = api.request("POST", "/v1/models", json={}, headers=key_headers(key))

    assert_error(response, "models", 405, "invalid_request_error")
    assert response.headers["allow"] == "GET"


@pytest.mark.parametrize(
    ("path", "headers", "shape"),
    [
        ("/v1/nope", {}, "openai"),
        ("/v1/chat/completions/", {}, "openai"),
        ("/v1/chat", {}, "openai"),
        ("/v1/messages/batches", {}, "messages"),
        ("/v1/complete", {"anthropic-version": "2023-06-01"}, "messages"),
    ],
)
def test_an_unknown_path_under_v1_is_404_in_the_protocols_shape(api, path, headers, shape):
    for method in ["GET", "POST"]:
        response = api.request(method, path, headers=headers)
        expected_type = "not_found_error" if shape == "messages" else "invalid_request_error"
        error = assert_error(response, shape, 404, expected_type)
        assert path in error["message"]


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_a_body_that_stops_arriving_is_408_in_the_protocols_shape(api, key, settings, protocol):
    # given: a client that sends the start of a body and then nothing (or a Content-Length it never fills)
    settings.SLUICE_BODY_READ_TIMEOUT_S = 0.3

    async def stalled_body():
        yield b'{"model": "smollm2-135m-instruct", '
        await asyncio.sleep(3600)

    # when
    response = api.request("POST", PATHS[protocol], content=stalled_body(), headers=key_headers(key))

    # then
    assert_error(response, protocol, 408, "invalid_request_error")


def test_a_slow_body_that_arrives_in_time_is_served(api, key, settings):
    settings.SLUICE_BODY_READ_TIMEOUT_S = 5
    content = json.dumps(valid_body("messages.count_tokens")).encode()

    async def trickled_body():
        for start in range(0, len(content), 20):
            await asyncio.sleep(0.01)
            yield content[start : start + 20]

    response = api.request("POST", PATHS["messages.count_tokens"], content=trickled_body(), headers=key_headers(key))

    assert response.status_code == 200 and response.json()["input_tokens"] > 0


def heartbeat(role: str, state: str = "ready") -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=f"{role}-0",
        role=role,
        model="m",
        request_endpoint=f"ipc:///{role}",
        max_model_len=8192,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        num_free_pages=10,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        sent_at=0.0,
        state=state,
    )


@pytest.mark.parametrize(
    ("workers", "status"),
    [
        ([heartbeat("prefill")], 503),
        ([heartbeat("decode")], 503),
        ([heartbeat("prefill"), heartbeat("decode", "draining")], 503),
        ([heartbeat("prefill"), heartbeat("decode")], 200),
        ([heartbeat("mixed")], 200),
        ([heartbeat("mixed"), heartbeat("prefill")], 200),
    ],
)
def test_healthz_is_healthy_only_when_a_request_can_be_served(api, monkeypatch, workers, status):
    class Client:
        def healthy_workers(self):
            return workers

    async def engine_client():
        return Client()

    monkeypatch.setattr("controlplane.gateway.views.engine_client", engine_client)

    response = api.request("GET", "/healthz")

    assert response.status_code == status
    assert response.json()["status"] == ("ok" if status == 200 else "unavailable")
    assert [worker["role"] for worker in response.json()["workers"]] == [worker.role for worker in workers]
