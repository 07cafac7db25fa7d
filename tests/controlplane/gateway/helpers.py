"""Request bodies, error-shape checks and a fake engine for the gateway tests."""

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx

from workers.protocol.messages import GenerateOutput, GenerateRequest

SMOLLM2 = "smollm2-135m-instruct"
PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "messages.count_tokens": "/v1/messages/count_tokens",
}
GENERATION_PROTOCOLS = ["chat.completions", "completions", "responses", "messages"]
ALL_PROTOCOLS = [*GENERATION_PROTOCOLS, "messages.count_tokens"]


def valid_body(protocol: str, **fields) -> dict:
    hello = [{"role": "user", "content": "Say hello."}]
    bodies = {
        "chat.completions": {"messages": hello, "max_tokens": 4},
        "completions": {"prompt": "Hello,", "max_tokens": 4},
        "responses": {"input": "Say hello.", "max_output_tokens": 4},
        "messages": {"messages": hello, "max_tokens": 4},
        "messages.count_tokens": {"messages": hello},
    }
    return {"model": SMOLLM2, **bodies[protocol], **fields}


def key_headers(key: str, header: str = "authorization") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if header == "authorization" else {"x-api-key": key}


def assert_error(response: httpx.Response, protocol: str, status: int, error_type: str) -> dict:
    """The status, and the body in the protocol's own error shape; returns the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    if protocol.startswith("messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type and body["error"]["message"]
    return body["error"]


def sse_frames(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) per frame; checks that every frame is well formed."""
    assert text.endswith("\n\n"), text[-200:]
    frames = []
    for frame in text[:-2].split("\n\n"):
        event, data = None, []
        for line in frame.split("\n"):
            field, separator, value = line.partition(": ")
            assert separator and field in ("event", "data"), line
            if field == "event":
                event = value
            else:
                data.append(value)
        frames.append((event, "\n".join(data)))
    return frames


class FakeEngine:
    """Stands in for EngineClient: each request's outputs come from `script`; records what ran."""

    def __init__(self, script: Callable[[GenerateRequest], AsyncIterator[GenerateOutput]]) -> None:
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.closed_early: list[str] = []

    async def generate(self, request: GenerateRequest, images=()) -> AsyncIterator[GenerateOutput]:
        self.requests.append(request)
        try:
            async for output in self.script(request):
                yield output
        except (GeneratorExit, asyncio.CancelledError):
            # Closed before its last output: what the real client turns into an AbortRequest.
            self.closed_early.append(request.request_id)
            raise

    def healthy_workers(self) -> list:
        return []


def three_token_script(*, cached: int):
    """A FakeEngine script: three one-token outputs, the last with finish_reason "length"; the prompt
    had `cached` tokens cached."""

    async def script(request):
        for index in range(3):
            yield GenerateOutput(
                request_id=request.request_id,
                token_ids=[28 + index],
                text="a",
                finish_reason="length" if index == 2 else None,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=cached,
            )

    return script
