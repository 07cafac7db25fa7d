"""Tool calling through Chat Completions: tool_choice required / named / auto / none, streaming, round trip."""

import json

import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(stack, **kwargs):
    return stack.openai().chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60, **kwargs)


def test_required_tool_choice_calls_a_declared_tool_with_valid_arguments(stack):
    response = call(stack, tools=[WEATHER, TIME], tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = choice.message.tool_calls[:1]
    assert tool_call.function.name in {"get_weather", "get_time"}
    assert isinstance(json.loads(tool_call.function.arguments), dict)
    assert tool_call.id


def test_named_tool_choice_calls_that_tool(stack):
    response = call(stack, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = response.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert "timezone" in json.loads(calls[0].function.arguments)


def test_none_tool_choice_answers_in_text(stack):
    response = call(stack, tools=[WEATHER], tool_choice="none")
    assert not response.choices[0].message.tool_calls
    assert response.choices[0].message.content


def test_auto_tool_choice_gives_a_well_formed_answer(stack):
    choice = call(stack, tools=[WEATHER], tool_choice="auto").choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in choice.message.tool_calls)
    else:
        assert choice.finish_reason in {"stop", "length"} and choice.message.content


def test_streamed_tool_call_matches_the_non_stream_call(stack):
    full = call(stack, tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls[0]
    chunks = list(
        stack.openai().chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=0,
            max_tokens=60,
            tools=[WEATHER],
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    ids = [d.id for d in deltas if d.id]
    names = [d.function.name for d in deltas if d.function and d.function.name]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert len(ids) == 1 and names == [full.function.name]
    assert json.loads(arguments) == json.loads(full.function.arguments)


def test_tool_result_round_trip(stack):
    first = call(stack, tools=[WEATHER], tool_choice="required").choices[0].message
    tool_call = first.tool_calls[0]
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": tool_call.id,
                    "type": "function",
                    "function": {"name": tool_call.function.name, "arguments": tool_call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 24 degrees Celsius."},
    ]
    answer = stack.openai().chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    choice = answer.choices[0]
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    assert choice.message.content or choice.message.tool_calls
