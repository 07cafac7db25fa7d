"""The prompt cache in each API's usage, from the engine's outputs: Anthropic's cache creation by
breakpoint ttl and reads, OpenAI's cache writes, and the Responses echo of the request's settings."""

import json

import deepseek_recipe as dr
import pytest

from recipe.api import PreparedRequest, ServedModel, prepare_request
from workers.protocol.messages import GenerateOutput
from workers.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE_MINUTES = {"type": "ephemeral", "ttl": "5m"}


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Tokenizer, smollm2_files) -> dict[str, ServedModel]:
    codec_tokenizer = dr.Tokenizer.from_file(str(smollm2_files.tokenizer_file))
    return {MODEL: ServedModel(MODEL, smollm2_tokenizer, "chatml", 2048, codec_tokenizer)}


def run(prepared: PreparedRequest, outputs: list[GenerateOutput]) -> tuple[list[tuple[str | None, dict]], dict]:
    builder = prepared.new_response("resp_test", 1700000000)
    events = [event for output in outputs for event in builder.push(0, output)] + builder.finish()
    parsed = [(event.event, json.loads(event.data)) for event in events if event.data != "[DONE]"]
    return parsed, builder.body()


def outputs(prompt_tokens: int, *, cached: int, stored: int, by_hint: tuple[int, ...] = ()) -> list[GenerateOutput]:
    """Two tokens; as from a prefill worker, the prompt counts come with every output."""
    counts = {
        "num_prompt_tokens": prompt_tokens,
        "num_cached_tokens": cached,
        "num_stored_tokens": stored,
        "stored_tokens_by_hint": by_hint,
    }
    return [
        GenerateOutput(request_id="r", token_ids=[28], text="A", **counts),
        GenerateOutput(request_id="r", token_ids=[2], text="", finish_reason="stop", **counts),
    ]


def test_anthropic_usage_splits_the_prompt_into_creation_by_ttl_reads_and_the_rest(models) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "system": [{"type": "text", "text": "Be kind.", "cache_control": HOUR}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi!", "cache_control": FIVE_MINUTES}]}],
    }
    prepared = prepare_request("messages", body, models)
    assert [hint.retain_s for hint in prepared.cache_hints] == [3600.0, 300.0]

    events, response = run(prepared, outputs(400, cached=128, stored=256, by_hint=(128, 64)))

    expected = {
        "input_tokens": 400 - 128 - 192,
        "cache_read_input_tokens": 128,
        "cache_creation_input_tokens": 192,
        "cache_creation": {"ephemeral_5m_input_tokens": 64, "ephemeral_1h_input_tokens": 128},
    }
    [start] = [data["message"]["usage"] for name, data in events if name == "message_start"]
    [delta] = [data["usage"] for name, data in events if name == "message_delta"]
    assert {field: start[field] for field in expected} == expected
    assert {field: response["usage"][field] for field in expected} == expected
    assert {field: delta[field] for field in expected if field != "cache_creation"} == {
        field: value for field, value in expected.items() if field != "cache_creation"
    }


def test_anthropic_usage_without_breakpoints_reports_no_creation(models) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi!"}]}

    _, response = run(prepare_request("messages", body, models), outputs(300, cached=0, stored=256))

    assert response["usage"]["cache_creation_input_tokens"] == 0 and response["usage"]["input_tokens"] == 300
    assert response["usage"]["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}


def test_responses_report_cache_writes_and_echo_the_cache_settings(models) -> None:
    body = {
        "model": MODEL,
        "input": "Hi!",
        "stream": True,
        "prompt_cache_key": "user-7",
        "prompt_cache_retention": "24h",
    }

    events, response = run(
        prepare_request("responses", body, models), outputs(300, cached=128, stored=128, by_hint=(128,))
    )

    responses = [data["response"] for name, data in events if name.startswith("response.") and "response" in data]
    assert [event["type"] for _, event in events if "response" in event][-1] == "response.completed"
    for each in [*responses, response]:
        assert (each["prompt_cache_key"], each["prompt_cache_retention"]) == ("user-7", "24h")
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 128, "cache_write_tokens": 128}
    assert responses[-1]["usage"] == response["usage"]


def test_a_response_without_cache_settings_echoes_none(models) -> None:
    _, response = run(
        prepare_request("responses", {"model": MODEL, "input": "Hi!"}, models), outputs(30, cached=0, stored=0)
    )

    assert (response["prompt_cache_key"], response["prompt_cache_retention"]) == (None, None)


@pytest.mark.parametrize(
    ("protocol", "body"),
    [
        (
            "chat.completions",
            {
                "messages": [{"role": "user", "content": "Hi!"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        ("completions", {"prompt": "Hi!", "stream": True, "stream_options": {"include_usage": True}}),
    ],
)
def test_openai_usage_reports_the_prompt_tokens_written_to_the_cache(models, protocol, body) -> None:
    events, response = run(
        prepare_request(protocol, {"model": MODEL, **body}, models), outputs(300, cached=128, stored=128)
    )

    assert response["usage"]["prompt_tokens_details"] == {"cached_tokens": 128, "cache_write_tokens": 128}
    assert events[-1][1]["usage"] == response["usage"]


def test_responses_break_writes_under_explicit_breakpoints_down_by_ttl_and_echo_the_options(models) -> None:
    parts = [
        {"type": "input_text", "text": "Rules.", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}},
        {"type": "input_text", "text": "Question?", "prompt_cache_breakpoint": {"mode": "explicit"}},
    ]
    options = {"mode": "explicit", "ttl": "30m"}
    request = {"model": MODEL, "input": [{"role": "user", "content": parts}], "prompt_cache_options": options}

    _, response = run(
        prepare_request("responses", request, models), outputs(300, cached=0, stored=256, by_hint=(64, 128))
    )

    assert response["prompt_cache_options"] == options
    assert response["usage"]["input_tokens_details"] == {
        "cached_tokens": 0,
        "cache_write_tokens": 256,
        "cache_write_tokens_details": {"ttl_30m_tokens": 128, "ttl_12h_tokens": 64},
    }
