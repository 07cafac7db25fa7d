"""Anthropic Messages through the official anthropic SDK."""

import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# This SDK version no longer takes `temperature` as an argument; the API still accepts it.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_non_stream_message(stack):
    message = stack.anthropic().messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY)
    assert message.role == "assistant" and message.stop_reason == "end_turn"
    assert "Paris" in message.content[0].text
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_final_text_equals_non_stream(stack):
    client = stack.anthropic()
    full = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY) as stream:
        text = stream.get_final_text()
    assert text == full.content[0].text


def test_max_tokens_and_stop_sequences(stack):
    client = stack.anthropic()
    limited = client.messages.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Tell me a long story."}], extra_body=GREEDY
    )
    assert limited.stop_reason == "max_tokens" and limited.usage.output_tokens == 5
    full = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY).content[0].text
    stop = full[4:8]
    stopped = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == full[: full.index(stop)]


def test_tool_use_streams_input_json_and_round_trips(stack):
    client = stack.anthropic()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(
        model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY
    )
    assert message.stop_reason == "tool_use"
    tool_use = next(block for block in message.content if block.type == "tool_use")
    assert tool_use.name == "get_weather" and isinstance(tool_use.input, dict)

    with client.messages.stream(
        model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    streamed_tool = next(block for block in final.content if block.type == "tool_use")
    assert streamed_tool.input == tool_use.input

    answer = client.messages.create(
        model=MODEL,
        max_tokens=40,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[
            *ask,
            {"role": "assistant", "content": message.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "Sunny, 24 degrees."}],
            },
        ],
    )
    assert answer.stop_reason in {"end_turn", "max_tokens", "tool_use"}
    assert answer.content


def test_count_tokens(stack):
    client = stack.anthropic()
    counted = client.messages.count_tokens(model=MODEL, messages=ASK)
    used = client.messages.create(model=MODEL, max_tokens=1, messages=ASK, extra_body=GREEDY)
    # Anthropic reports prompt tokens read from the cache apart from input_tokens.
    usage = used.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert counted.input_tokens == prompt
    assert counted.input_tokens > 0
