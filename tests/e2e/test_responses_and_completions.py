"""OpenAI Responses and legacy Completions through the official SDK."""

import json

import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_responses_non_stream_completed(stack):
    response = stack.openai().responses.create(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=40
    )
    assert response.status == "completed"
    assert "Paris" in response.output_text


def test_responses_incomplete_at_max_output_tokens(stack):
    response = stack.openai().responses.create(
        model=MODEL, input="Write a long story about a dragon.", temperature=0, max_output_tokens=16
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16


def test_responses_stream_from_created_to_completed(stack):
    events = list(
        stack.openai().responses.create(
            model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=40, stream=True
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


def test_responses_stream_helper_final_response(stack):
    with stack.openai().responses.stream(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=30
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and "Paris" in final.output_text


def test_responses_function_call_item(stack):
    response = stack.openai().responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments), dict) and calls[0].call_id


def test_completions_with_echo_logprobs_and_n(stack):
    prompt = "The capital of France is"
    response = stack.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2, n=2
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.text.startswith(prompt)
        logprobs = choice.logprobs
        assert logprobs.token_logprobs[0] is None  # the first prompt token has no context
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset)
        assert response.usage.prompt_tokens + 5 == len(logprobs.tokens)
        # The k most likely tokens, plus the chosen one when it is not among them (as OpenAI does).
        assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert response.choices[0].text == response.choices[1].text  # greedy


def test_completions_stream(stack):
    client = stack.openai()
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == full.choices[0].text
