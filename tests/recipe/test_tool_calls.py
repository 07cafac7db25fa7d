import json

import deepseek_recipe as dr
import pytest

from recipe.tool_calls import ToolCallAdapter

ARGUMENTS = {
    "city": 'Par"is\n</x> ü',
    "days": 3,
    "ratio": -0.5,
    "metric": True,
    "note": None,
    "filters": {"kinds": ["rain", {"min": 1}]},
    "empty": "",
}
CALL = f"<tool_call>{json.dumps({'name': 'get_weather', 'arguments': ARGUMENTS})}</tool_call>"
SECOND_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CONVERSION = dr.ConversionOptions(default_thinking_mode=False).with_model_alias("m", dr.ModelVersion.DeepseekV41Flash)


def adapt(pieces: list[str], *, starts_in_tool_call: bool = False) -> str:
    adapter = ToolCallAdapter(starts_in_tool_call=starts_in_tool_call)
    return "".join(adapter.push(piece) for piece in pieces) + adapter.finish()


def library_dsml(*calls: tuple[str, dict]) -> str:
    """The calls block as deepseek-recipe renders an assistant message with these calls."""
    tool_calls = [dr.ToolCall(f"call_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
    conversation = dr.Conversation([dr.UserMessage("u"), dr.AssistantMessage("", tool_calls=tool_calls)])
    prompt = dr.DeepseekV41Encoding().render_conversation(conversation).prompt
    closing = "</｜DSML｜ calls>"
    return prompt[prompt.index("<｜DSML｜ calls>") : prompt.index(closing) + len(closing)]


def parsed_message(text: str) -> dict:
    """What deepseek-recipe makes of adapted text: the Chat Completions message."""
    body = {"model": "m", "messages": [{"role": "user", "content": "u"}], "tools": TOOLS}
    request = dr.ChatCompletionRequest(body).convert(CONVERSION)
    generator = dr.ChatCompletionRequest.chunk_generator(request, "id", "m")
    processor = dr.StreamProcessor(generator, request.parsing_options)
    response = dr.ChatCompletionResponse("id", "m", 0, 0, 0)
    chunks = processor.push(dr.InferenceChunk.ready())
    chunks += processor.push(dr.InferenceChunk.text(text, 1))
    chunks += processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    for chunk in chunks + processor.finish():
        response.accumulate(chunk)
    return json.loads(response.to_json())["choices"][0]["message"]


def test_plain_text_passes_through_unchanged() -> None:
    text = "Use <b>bold</b>, a < b, and <tool_ca as text."

    assert adapt([text]) == text


def test_text_that_may_start_a_tag_is_held_back_until_decided() -> None:
    adapter = ToolCallAdapter(starts_in_tool_call=False)

    assert adapter.push("Sure <tool") == "Sure "
    assert adapter.push("box>") == "<toolbox>"
    assert adapter.push("<tool_c") == ""
    assert adapter.finish() == "<tool_c"


def test_a_call_becomes_the_dsml_the_library_renders() -> None:
    assert adapt([CALL]) == library_dsml(("get_weather", ARGUMENTS))
    assert adapt([CALL, "\n", SECOND_CALL]) == library_dsml(("get_weather", ARGUMENTS), ("get_time", {}))


def test_any_split_of_the_stream_gives_the_same_output() -> None:
    text = "Let me check <the> weather.\n" + CALL + "\n" + SECOND_CALL
    whole = adapt([text])

    for cut in range(len(text) + 1):
        assert adapt([text[:cut], text[cut:]]) == whole, cut
    assert adapt(list(text)) == whole


def test_the_library_parses_adapted_calls_back_into_the_same_arguments() -> None:
    message = parsed_message(adapt(["Checking.\n", CALL, SECOND_CALL]))

    assert message["content"] == "Checking."
    calls = message["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGUMENTS
    assert json.loads(calls[1]["function"]["arguments"]) == {}


@pytest.mark.parametrize(
    "body",
    ['{"name": "get_weather", "arguments": {"city": ', '{"arguments": {}}', "[]", '{"name": "f", "arguments": NaN}'],
)
def test_a_block_that_is_not_a_call_passes_through_as_text(body: str) -> None:
    text = f"Before <tool_call>{body}</tool_call> after"

    assert adapt([text]) == text


def test_an_unclosed_block_is_text_at_the_end() -> None:
    assert adapt(['Hi <tool_call>{"name": "get_we']) == 'Hi <tool_call>{"name": "get_we'


def test_output_that_starts_inside_a_call_opened_by_the_prompt() -> None:
    body = CALL.removeprefix("<tool_call>")

    assert adapt([body], starts_in_tool_call=True) == library_dsml(("get_weather", ARGUMENTS))
    # Truncated (max_tokens): the client sees what the model wrote, without the prompt's opener.
    assert adapt(['{"name": "get_wea'], starts_in_tool_call=True) == '{"name": "get_wea'


def test_a_list_of_calls_in_one_block_and_arguments_as_a_json_string() -> None:
    block = (
        '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"days\\": 2}"}]'
    )

    assert adapt([block + "</tool_call>"]) == library_dsml(("get_time", {}), ("get_weather", {"days": 2}))


def test_text_after_the_calls_is_dropped_as_the_library_would() -> None:
    text = CALL + " and then " + SECOND_CALL + " done"

    assert adapt([text]) == library_dsml(("get_weather", ARGUMENTS), ("get_time", {}))
