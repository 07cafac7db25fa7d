"""Chat Completions through the official openai SDK against the running stack and the real model."""

import json

import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(stack):
    models = stack.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_stream_joins_to_the_non_stream_text_with_role_once_and_one_finish_reason(stack):
    client = stack.openai()
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    roles = [c.choices[0].delta.role for c in with_choices if c.choices[0].delta.role]
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert roles == ["assistant"] and with_choices[0].choices[0].delta.role == "assistant"
    assert finishes == [full.choices[0].finish_reason] == ["stop"]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == full.choices[0].message.content
    assert "Paris" in full.choices[0].message.content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens > 0


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limit_gives_length_with_the_exact_count(stack, field):
    response = stack.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        temperature=0,
        **{field: 7},
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 7


def test_stop_string_ends_the_text_before_it(stack):
    client = stack.openai()
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    text = free.choices[0].message.content
    stop = text[4:8]
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_n_choices_and_seeded_sampling(stack):
    client = stack.openai()
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a fun fact."}],
        temperature=1.0,
        max_tokens=20,
        seed=1234,
        n=3,
    )
    first = client.chat.completions.create(**request)
    second = client.chat.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1
    other_seed = client.chat.completions.create(**{**request, "seed": 99, "n": 1})
    assert other_seed.choices[0].message.content != first.choices[0].message.content


def test_n_choices_stream_with_indexes(stack):
    chunks = list(
        stack.openai().chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0.8, max_tokens=12, n=2, seed=7, stream=True
        )
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_logprobs_with_top_logprobs(stack):
    response = stack.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_json_object_output_parses(stack):
    response = stack.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_json_schema_output_validates(stack):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    response = stack.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the largest city of Japan and its population."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        temperature=0,
        max_tokens=60,
    )
    parsed = json.loads(response.choices[0].message.content)
    assert set(parsed) == {"city", "population"}
    assert isinstance(parsed["city"], str) and isinstance(parsed["population"], int)


def test_usage_reports_cached_prompt_tokens_on_a_repeated_prefix(stack):
    client = stack.openai()
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 20},
        {"role": "user", "content": "Say hi."},
    ]
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * ((again.usage.prompt_tokens - 1) // 16)
