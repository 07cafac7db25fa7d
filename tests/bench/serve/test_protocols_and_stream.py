import asyncio

import httpx
import numpy as np
import pytest

from bench.serve.api_protocols import API_PROTOCOLS, GenerationSettings, StreamUpdate, Usage
from bench.serve.client import send_request
from bench.serve.datasets.request import BenchRequest
from bench.serve.sse import SseEvent, sse_events

REQUEST = BenchRequest(prompt_ids=np.array([5, 6, 7]), output_len=4, text="hello")
SETTINGS = GenerationSettings(model="m", temperature=0.0, ignore_eos=True)


async def lines_of(text):
    for line in text.split("\n"):
        yield line


def events(text):
    async def collect():
        return [event async for event in sse_events(lines_of(text))]

    return asyncio.run(collect())


def test_sse_events_join_data_lines_and_keep_the_event_name():
    text = ': keep-alive\n\nevent: message_start\ndata: {"a":\ndata: 1}\n\ndata: [DONE]'

    assert events(text) == [SseEvent("message_start", '{"a":\n1}'), SseEvent(None, "[DONE]")]


def test_bodies_carry_the_prompt_its_length_and_ignore_eos_only_when_asked():
    completions = API_PROTOCOLS["completions"].body(REQUEST, SETTINGS)
    chat = API_PROTOCOLS["chat"].body(REQUEST, GenerationSettings(model="m", temperature=0.0, ignore_eos=False))
    messages = API_PROTOCOLS["messages"].body(REQUEST, SETTINGS)

    assert completions["prompt"] == [5, 6, 7] and completions["max_tokens"] == 4 and completions["ignore_eos"]
    assert completions["stream_options"] == {"include_usage": True} and completions["temperature"] == 0.0
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "ignore_eos" not in chat
    assert messages["messages"][0]["content"] == "hello" and messages["stream"] and messages["ignore_eos"]
    assert API_PROTOCOLS["chat"].headers("k") == {"Authorization": "Bearer k"}
    assert API_PROTOCOLS["messages"].headers("k")["x-api-key"] == "k"


def test_openai_events_give_text_usage_and_the_end():
    chat = API_PROTOCOLS["chat"]

    assert chat.read(SseEvent(None, '{"choices": [{"delta": {"role": "assistant"}}]}')) == StreamUpdate()
    assert chat.read(SseEvent(None, '{"choices": [{"delta": {"content": "Hi"}}]}')).text == "Hi"
    usage = chat.read(
        SseEvent(
            None,
            '{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, '
            '"prompt_tokens_details": {"cached_tokens": 8}}}',
        )
    )
    assert usage.usage == Usage(prompt_tokens=9, output_tokens=4, cached_tokens=8)
    assert chat.read(SseEvent(None, "[DONE]")).done
    assert chat.read(SseEvent(None, '{"error": {"message": "overloaded"}}')).error == "overloaded"
    assert API_PROTOCOLS["completions"].read(SseEvent(None, '{"choices": [{"text": " ok"}]}')).text == " ok"


def test_anthropic_events_count_the_whole_prompt_and_the_output():
    messages = API_PROTOCOLS["messages"]
    start = SseEvent(
        "message_start",
        '{"type": "message_start", "message": {"usage": {"input_tokens": 3, '
        '"cache_creation_input_tokens": 2, "cache_read_input_tokens": 16, "output_tokens": 1}}}',
    )

    assert messages.read(start).usage == Usage(prompt_tokens=21, cached_tokens=16)
    delta = '{"type": "message_delta", "usage": {"input_tokens": 3, "output_tokens": 4}}'
    assert messages.read(SseEvent("message_delta", delta)).usage == Usage(output_tokens=4)
    text = '{"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}'
    assert messages.read(SseEvent("content_block_delta", text)).text == "Hi"
    assert messages.read(SseEvent("message_stop", '{"type": "message_stop"}')).done
    error = '{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}'
    assert messages.read(SseEvent("error", error)).error == "busy"


def send_through(handler, api="chat"):
    async def send():
        async with httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(handler)) as http:
            return await send_request(http, API_PROTOCOLS[api], REQUEST, SETTINGS, "key")

    return asyncio.run(send())


def sse(*payloads):
    return "".join(f"data: {payload}\n\n" for payload in payloads).encode()


def test_a_stream_is_timed_and_counted_from_usage():
    def server(request):
        assert request.url.path == "/v1/chat/completions" and request.headers["authorization"] == "Bearer key"
        body = sse(
            '{"choices": [{"delta": {"content": "a"}}]}',
            '{"choices": [{"delta": {"content": "bc"}}]}',
            '{"choices": [{"delta": {"content": "d"}}]}',
            '{"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 4}}',
            "[DONE]",
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    result = send_through(server)

    assert result.error is None
    assert (result.prompt_tokens, result.output_tokens, result.cached_tokens) == (12, 4, None)
    assert len(result.itl_s) == 2 and result.ttft_s is not None and result.e2e_s >= result.ttft_s


def test_without_usage_output_tokens_are_the_text_chunks():
    def server(request):
        return httpx.Response(
            200, content=sse('{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}', "[DONE]")
        )

    result = send_through(server, api="completions")

    assert result.error is None and result.output_tokens == 2 and result.prompt_tokens == 3


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(429, json={"error": {"message": "rate limited"}}), "HTTP 429: rate limited"),
        (httpx.Response(502, content=b"<html>bad gateway</html>"), "HTTP 502: <html>bad gateway</html>"),
        (httpx.Response(200, content=sse('{"choices": [{"delta": {"content": "a"}}]}')), "ended before its end marker"),
        (httpx.Response(200, content=sse("{truncated")), "malformed stream event"),
        (httpx.Response(200, content=sse('{"error": {"message": "worker died"}}')), "stream error: worker died"),
    ],
)
def test_failures_become_the_results_error(response, error):
    result = send_through(lambda request: response)

    assert result.error is not None and error in result.error
    assert result.output_tokens == 0


def test_a_connection_failure_becomes_the_results_error():
    def server(request):
        raise httpx.ConnectError("connection refused")

    assert send_through(server).error == "ConnectError: connection refused"


class CutStream(httpx.AsyncByteStream):
    """One event, then the connection breaks."""

    async def __aiter__(self):
        yield sse('{"choices": [{"delta": {"content": "a"}}]}')
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_a_stream_cut_mid_way_becomes_the_results_error():
    result = send_through(lambda request: httpx.Response(200, stream=CutStream()))

    assert result.error.startswith("RemoteProtocolError: peer closed connection")
