"""Every error boundary raises the SDK's matching exception, and the server keeps serving."""

import anthropic
import httpx2
import openai
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Hi"}]


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
