"""Every error boundary raises the SDK's matching exception (or, for what no SDK sends, answers raw
HTTP in the protocol's shape), and the server keeps serving."""

import json
import socket
import time

import anthropic
import httpx
import httpx2
import openai
import pytest

from controlplane.settings import SLUICE_HEADER_READ_TIMEOUT_S as HEADER_READ_TIMEOUT_S
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Hi"}]
IDLE_CONNECTIONS = 100


class TruncatingTransport(httpx2.HTTPTransport):
    """Sends every request body cut in half: malformed JSON that no SDK would produce itself."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        broken = httpx2.Request(request.method, request.url, headers=request.headers, content=body[: len(body) // 2])
        broken.headers["content-length"] = str(len(broken.content))
        return super().handle_request(broken)


def still_serving(stack) -> None:
    reply = stack.openai().chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in {"stop", "length"}


def test_wrong_key(stack):
    with pytest.raises(openai.AuthenticationError) as raised:
        openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key="sk-sluice-wrong", max_retries=0
        ).chat.completions.create(model=MODEL, messages=HI)
    assert raised.value.body["type"] == "authentication_error" or raised.value.status_code == 401
    with pytest.raises(anthropic.AuthenticationError) as anthropic_raised:
        anthropic.Anthropic(base_url=stack.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=HI
        )
    assert anthropic_raised.value.body["error"]["type"] == "authentication_error"
    still_serving(stack)


def test_unknown_model(stack):
    with pytest.raises(openai.NotFoundError):
        stack.openai().chat.completions.create(model="no-such-model", messages=HI)
    with pytest.raises(anthropic.NotFoundError):
        stack.anthropic().messages.create(model="no-such-model", max_tokens=5, messages=HI)
    still_serving(stack)


def test_prompt_past_the_context_window(stack):
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as raised:
        stack.openai().chat.completions.create(model=MODEL, messages=long, max_tokens=5)
    assert "context" in str(raised.value).lower()
    with pytest.raises(anthropic.BadRequestError):
        stack.anthropic().messages.create(model=MODEL, max_tokens=5, messages=long)
    still_serving(stack)


def test_malformed_json(stack):
    broken_openai = stack.openai(http_client=httpx2.Client(transport=TruncatingTransport()))
    with pytest.raises(openai.BadRequestError):
        broken_openai.chat.completions.create(model=MODEL, messages=HI)
    broken_anthropic = stack.anthropic(http_client=httpx2.Client(transport=TruncatingTransport()))
    with pytest.raises(anthropic.BadRequestError) as raised:
        broken_anthropic.messages.create(model=MODEL, max_tokens=5, messages=HI)
    assert raised.value.body["type"] == "error"
    still_serving(stack)


def test_oversized_body(stack):
    huge = [{"role": "user", "content": "x" * (5 << 20)}]
    with pytest.raises(openai.APIStatusError) as raised:
        stack.openai().chat.completions.create(model=MODEL, messages=huge)
    assert raised.value.status_code == 413
    with pytest.raises(anthropic.RequestTooLargeError):
        stack.anthropic().messages.create(model=MODEL, max_tokens=5, messages=huge)
    still_serving(stack)


def test_giant_integers_and_negative_top_k_are_400s_that_name_the_field(stack):
    for fields, param in [
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"logit_bias": {"²": 5}}, "logit_bias"),
    ]:
        with pytest.raises(openai.BadRequestError) as raised:
            stack.openai().chat.completions.create(model=MODEL, messages=HI, **fields)
        assert raised.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as raised:
        stack.openai().responses.create(model=MODEL, input="Hi", max_output_tokens=10**30)
    assert raised.value.body["param"] == "max_output_tokens"
    with pytest.raises(anthropic.BadRequestError) as anthropic_raised:
        stack.anthropic().messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body={"top_k": 10**20})
    assert "`top_k`" in anthropic_raised.value.body["error"]["message"]
    still_serving(stack)


def test_lone_surrogates_and_invalid_utf8_are_400s_that_name_the_field(stack):
    # No SDK sends a lone surrogate (they encode bodies as UTF-8): raw JSON does, as a \ud800 escape.
    openai_headers = {"authorization": f"Bearer {stack.api_key}", "content-type": "application/json"}
    for fields, param in [({"prompt": "Hi \ud800"}, "prompt"), ({"prompt": "Hi", "stop": ["\udfff"]}, "stop[0]")]:
        body = json.dumps({"model": MODEL, "max_tokens": 3, **fields})
        assert "\\ud" in body
        response = httpx.post(f"{stack.base_url}/v1/completions", content=body, headers=openai_headers)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    raw = b'{"model": "%s", "max_tokens": 3, "messages": [{"role": "user", "content": "caf\xe9"}]}' % MODEL.encode()
    anthropic_headers = {"x-api-key": stack.api_key, "content-type": "application/json"}
    response = httpx.post(f"{stack.base_url}/v1/messages", content=raw, headers=anthropic_headers)
    assert response.status_code == 400 and "`messages[0].content`" in response.json()["error"]["message"]
    still_serving(stack)


def test_content_and_schemas_nested_deep_are_400s(stack):
    nested: object = "hi"
    for _ in range(900):
        nested = [nested]
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(openai.BadRequestError):
        stack.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": nested}])
    with pytest.raises(anthropic.BadRequestError):
        stack.anthropic().messages.count_tokens(model=MODEL, messages=HI, tools=[{"name": "f", "input_schema": schema}])
    still_serving(stack)


def test_messages_without_max_tokens_is_a_400(stack):
    response = httpx.post(
        f"{stack.base_url}/v1/messages", json={"model": MODEL, "messages": HI}, headers={"x-api-key": stack.api_key}
    )

    assert response.status_code == 400
    assert response.json()["type"] == "error" and "`max_tokens`" in response.json()["error"]["message"]


def test_wrong_methods_and_unknown_paths_answer_in_the_protocols_shape(stack):
    wrong_method = httpx.get(
        f"{stack.base_url}/v1/chat/completions", headers={"authorization": f"Bearer {stack.api_key}"}
    )
    unknown = httpx.post(f"{stack.base_url}/v1/nope", json={})
    anthropic_unknown = httpx.get(f"{stack.base_url}/v1/messages/batches")

    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"
    assert anthropic_unknown.status_code == 404 and anthropic_unknown.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        stack.openai().get("/no-such-endpoint", cast_to=object)


def raw_http(stack, data: bytes) -> socket.socket:
    host, port = stack.base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=30)
    connection.sendall(data)
    return connection


def test_a_content_length_shorter_than_the_body_is_a_400(stack):
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 3}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {stack.api_key}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body) // 2}\r\nConnection: close\r\n\r\n"

    with raw_http(stack, head.encode() + body) as connection:
        reply = b""  # until the server closes the connection, as asked, after its answer
        while chunk := connection.recv(65536):
            reply += chunk

    assert reply.startswith(b"HTTP/1.1 400") and b"not valid JSON" in reply
    still_serving(stack)


def test_bodies_that_never_arrive_and_idle_connections_hold_nothing(stack):
    # given: a request whose Content-Length promises more than it sends, and connections that send nothing
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {stack.api_key}\r\n"
    head += 'Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"model": '
    lying = raw_http(stack, head.encode())
    idle = [raw_http(stack, b"") for _ in range(IDLE_CONNECTIONS)]

    try:
        # then: the server serves others meanwhile
        still_serving(stack)
        # and closes every idle connection once its head deadline passes
        deadline = time.monotonic() + HEADER_READ_TIMEOUT_S + 10
        for connection in idle:
            connection.settimeout(max(0.1, deadline - time.monotonic()))
            assert connection.recv(1) == b""
    finally:
        for connection in [lying, *idle]:
            connection.close()
    still_serving(stack)
