"""OpenAI Responses and Anthropic Messages through prepare_request and ResponseBuilder, fed the
outputs an engine would send."""

import json
from collections.abc import Callable

import deepseek_recipe as dr
import pytest

from recipe.api import PreparedRequest, ServedModel, SseEvent, count_tokens, prepare_request
from workers.protocol.messages import GenerateOutput
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
IM_END = 2
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NATIVE_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Tokenizer, smollm2_files) -> dict[str, ServedModel]:
    codec_tokenizer = dr.Tokenizer.from_file(str(smollm2_files.tokenizer_file))
    return {MODEL: ServedModel(MODEL, smollm2_tokenizer, "chatml", 2048, codec_tokenizer)}


def engine_outputs(tokenizer: Tokenizer, text: str, *, finish: str = "stop", eos: bool = True) -> list[GenerateOutput]:
    """One output per token, as the engine streams them; the last carries finish_reason."""
    token_ids = tokenizer.encode(text) + ([IM_END] if eos else [])
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [
        GenerateOutput(
            request_id="r",
            token_ids=[token_id],
            text=detokenizer.push([token_id]),
            finish_reason=finish if position == len(token_ids) - 1 else None,
            num_prompt_tokens=40,
            num_cached_tokens=16,
        )
        for position, token_id in enumerate(token_ids)
    ]


@pytest.fixture(scope="module")
def respond(smollm2_tokenizer: Tokenizer) -> Callable[..., tuple[list[SseEvent], dict]]:
    def respond(prepared: PreparedRequest, text: str, **output_options) -> tuple[list[SseEvent], dict]:
        builder = prepared.new_response("resp_test", 1700000000)
        events = []
        for output in engine_outputs(smollm2_tokenizer, text, **output_options):
            events += builder.push(0, output)
        events += builder.finish()
        return events, builder.body()

    return respond


def named_events(events: list[SseEvent]) -> list[tuple[str, dict]]:
    """Every event is named after its type, and none is a [DONE] marker."""
    parsed = [(event.event, json.loads(event.data)) for event in events]
    assert all(name == data["type"] for name, data in parsed)
    return parsed


def responses(models: dict, **fields) -> PreparedRequest:
    return prepare_request("responses", {"model": MODEL, "input": "Hi", **fields}, models)


def messages(models: dict, **fields) -> PreparedRequest:
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return prepare_request("messages", body, models)


def test_a_completed_response(models, respond) -> None:
    prepared = responses(models, instructions="Answer briefly.")

    _, body = respond(prepared, "Hello!")

    assert "Answer briefly." in models[MODEL].tokenizer.decode(prepared.prompt_token_ids)
    assert body["object"] == "response" and body["status"] == "completed" and body["id"] == "resp_test"
    [item] = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello!"
    assert body["usage"]["input_tokens"] == 40 and body["usage"]["input_tokens_details"] == {
        "cached_tokens": 16,
        "cache_write_tokens": 0,
    }
    assert body["usage"]["output_tokens"] == len(models[MODEL].tokenizer.encode("Hello!")) + 1


def test_max_output_tokens_makes_an_incomplete_response(models, respond) -> None:
    prepared = responses(models, max_output_tokens=3)

    _, body = respond(prepared, "One two three", finish="length", eos=False)

    assert prepared.sampling_params(0).max_tokens == 3
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_response_stream_runs_from_created_to_completed(models, respond) -> None:
    prepared = responses(models, stream=True)

    events, body = respond(prepared, "Hello there!")

    parsed = named_events(events)
    assert parsed[0][0] == "response.created" and parsed[-1][0] == "response.completed"
    assert [data["sequence_number"] for _, data in parsed] == list(range(len(parsed)))
    deltas = "".join(data["delta"] for name, data in parsed if name == "response.output_text.delta")
    assert deltas == body["output"][0]["content"][0]["text"] == "Hello there!"
    assert parsed[-1][1]["response"]["output"] == body["output"]


def test_a_response_function_call(models, respond) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA}]
    prepared = responses(models, tools=tools, stream=True)

    events, body = respond(prepared, "Checking.\n" + NATIVE_CALL)

    assert prepared.constraint.kind == "tool_call"
    call = next(item for item in body["output"] if item["type"] == "function_call")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    parsed = named_events(events)
    fragments = [data["delta"] for name, data in parsed if name == "response.function_call_arguments.delta"]
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    added = [data["item"] for name, data in parsed if name == "response.output_item.added"]
    assert [item["call_id"] for item in added if item["type"] == "function_call"] == [call["call_id"]]


def test_a_function_call_output_round_trip(models) -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA}]

    prepared = prepare_request("responses", {"model": MODEL, "input": items, "tools": tools}, models)

    prompt = models[MODEL].tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


def test_a_message(models, respond) -> None:
    prepared = messages(models, system="Be kind.", temperature=0.5, top_k=40)

    _, body = respond(prepared, "Hello!")

    assert prepared.sampling_params(0).top_k == 40 and prepared.sampling_params(0).temperature == 0.5
    assert "Be kind." in models[MODEL].tokenizer.decode(prepared.prompt_token_ids)
    assert body["type"] == "message" and body["role"] == "assistant" and body["id"] == "resp_test"
    assert body["content"] == [{"type": "text", "text": "Hello!"}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"]["input_tokens"] == 40 - 16 and body["usage"]["cache_read_input_tokens"] == 16
    assert body["usage"]["output_tokens"] == len(models[MODEL].tokenizer.encode("Hello!")) + 1


def test_ignore_eos_reaches_a_messages_sampling_params(models) -> None:
    # vLLM's extension, as on Chat Completions: benchmarks ask every API for outputs of a fixed length.
    assert messages(models, ignore_eos=True).sampling_params(0).ignore_eos
    assert not messages(models).sampling_params(0).ignore_eos
    assert not responses(models, ignore_eos=True).sampling_params(0).ignore_eos


def test_a_message_stream(models, respond) -> None:
    prepared = messages(models, stream=True)

    events, body = respond(prepared, "Hello there!")

    parsed = named_events(events)
    assert parsed[0][0] == "message_start" and parsed[-1][0] == "message_stop"
    deltas = [data["delta"]["text"] for name, data in parsed if name == "content_block_delta"]
    assert "".join(deltas) == body["content"][0]["text"] == "Hello there!"
    [message_delta] = [data for name, data in parsed if name == "message_delta"]
    assert message_delta["delta"]["stop_reason"] == "end_turn"


def test_a_stop_sequence_is_reported(models, respond) -> None:
    prepared = messages(models, stop_sequences=["END"])

    _, body = respond(prepared, "Hello END", eos=False)

    assert prepared.sampling_params(0).stop == ("END",)
    assert body["content"] == [{"type": "text", "text": "Hello "}]
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"


def test_max_tokens_stops_a_message(models, respond) -> None:
    prepared = messages(models, max_tokens=2)

    _, body = respond(prepared, "One two", finish="length", eos=False)

    assert prepared.sampling_params(0).max_tokens == 2
    assert body["stop_reason"] == "max_tokens"


def test_a_tool_use_streams_its_input_as_json_deltas(models, respond) -> None:
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": CITY_SCHEMA}]
    prepared = messages(models, tools=tools, tool_choice={"type": "any"}, stream=True)

    events, body = respond(prepared, NATIVE_CALL.removeprefix("<tool_call>"), eos=False)

    assert prepared.constraint.kind == "tool_call_required"
    assert [block["type"] for block in body["content"]] == ["tool_use"]
    assert body["content"][0]["input"] == {"city": "Paris"} and body["stop_reason"] == "tool_use"
    parsed = named_events(events)
    partial = [data["delta"]["partial_json"] for name, data in parsed if name == "content_block_delta"]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    starts = [data["content_block"] for name, data in parsed if name == "content_block_start"]
    assert [(block["type"], block["name"]) for block in starts] == [("tool_use", "get_weather")]


def test_a_tool_result_round_trip(models) -> None:
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    tools = [{"name": "get_weather", "input_schema": CITY_SCHEMA}]

    prepared = messages(models, messages=conversation, tools=tools)

    prompt = models[MODEL].tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


def test_count_tokens_is_the_prompt_length(models) -> None:
    body = {"model": MODEL, "system": "Be kind.", "messages": [{"role": "user", "content": "Hi there"}]}

    assert count_tokens(body, models) == len(messages(models, **body).prompt_token_ids)
