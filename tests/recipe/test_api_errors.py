"""Every way prepare_request refuses a request, and the small endpoints (models, count_tokens)."""

import deepseek_recipe as dr
import pytest

from recipe.api import ApiError, ServedModel, count_tokens, list_models, prepare_request
from workers.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
CONTEXT = 512
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Tokenizer, smollm2_files) -> dict[str, ServedModel]:
    codec_tokenizer = dr.Tokenizer.from_file(str(smollm2_files.tokenizer_file))
    return {MODEL: ServedModel(MODEL, smollm2_tokenizer, "chatml", CONTEXT, codec_tokenizer)}


def refusal(protocol: str, body: object, models: dict) -> ApiError:
    with pytest.raises(ApiError) as refused:
        prepare_request(protocol, body, models)
    return refused.value


def test_served_models_come_from_their_files(smollm2_files) -> None:
    model = ServedModel.from_model_files(smollm2_files, 8192)

    assert (model.name, model.family, model.max_model_len) == (MODEL, "chatml", 8192)
    assert model.codec_tokenizer.encode("Hello") == model.tokenizer.encode("Hello")


@pytest.mark.parametrize("protocol", ["chat.completions", "completions", "responses", "messages"])
def test_the_model_must_be_named_and_served(models, protocol: str) -> None:
    unknown = refusal(protocol, {"model": "gpt-9", "messages": USER, "prompt": "x", "input": "x"}, models)
    missing = refusal(protocol, {"messages": USER}, models)
    not_a_string = refusal(protocol, {"model": 7}, models)

    assert (unknown.status, unknown.type, unknown.param) == (404, "not_found_error", "model")
    assert MODEL in unknown.message
    assert (missing.status, missing.param) == (400, "model")
    assert (not_a_string.status, not_a_string.param) == (400, "model")
    assert refusal(protocol, ["not", "an", "object"], models).status == 400


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": "2"}, "n"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": CONTEXT}, "max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"messages": "Hi"}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]},
            "messages[0].content[1].image_url.url",
        ),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ],
)
def test_invalid_chat_fields_are_refused_with_their_name(models, fields: dict, param: str) -> None:
    refused = refusal("chat.completions", {"model": MODEL, "messages": USER, **fields}, models)

    assert (refused.status, refused.type, refused.param) == (400, "invalid_request_error", param)
    assert refused.message


def test_a_prompt_past_the_context_window_is_refused_before_any_work(models) -> None:
    long_text = "word " * CONTEXT
    long_messages = [{"role": "user", "content": long_text}]

    too_long = refusal("chat.completions", {"model": MODEL, "messages": long_messages}, models)
    no_room = refusal("responses", {"model": MODEL, "input": "Hi", "max_output_tokens": CONTEXT - 10}, models)

    assert (too_long.status, too_long.param) == (400, "max_tokens")
    assert "maximum context length is 512 tokens" in too_long.message
    assert (no_room.status, no_room.param) == (400, "max_output_tokens")


def test_json_mode_needs_json_in_the_prompt(models) -> None:
    body = {"model": MODEL, "messages": USER, "response_format": {"type": "json_object"}}

    refused = refusal("chat.completions", body, models)

    assert refused.status == 400 and "json" in refused.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 10, "messages": USER, "top_k": -1}, "top_k"),
        ({"max_tokens": 10}, "messages"),
    ],
)
def test_invalid_messages_fields_are_refused(models, body: dict, param: str) -> None:
    refused = refusal("messages", {"model": MODEL, **body}, models)

    assert (refused.status, refused.param) == (400, param)


def test_count_tokens_needs_a_served_model(models) -> None:
    with pytest.raises(ApiError) as refused:
        count_tokens({"model": "claude-9", "messages": USER}, models)

    assert refused.value.status == 404


def test_the_models_list(models) -> None:
    assert list_models(models, 1700000000) == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "sluice"}],
    }
