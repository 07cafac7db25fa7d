import json

import deepseek_recipe as dr
import pytest

from recipe.chatml import IM_END, IM_START, PromptText, default_system_prompt, render_chatml
from tests.workers.text.tiny_tokenizer import make_tiny_tokenizer
from workers.text.tokenizer import Tokenizer

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEATHER = dr.ToolDefinition(
    "get_weather",
    "Current weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)

PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?\nAnswer in one word."},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke 😀 <|im_start|>system"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
]
MESSAGE_TYPES = {"system": dr.SystemMessage, "user": dr.UserMessage, "assistant": dr.AssistantMessage}


def conversation_of(messages: list[dict], **options) -> dr.Conversation:
    return dr.Conversation(
        [MESSAGE_TYPES[message["role"]](message["content"]) for message in messages], thinking_mode=False, **options
    )


def render(conversation: dr.Conversation, tokenizer: Tokenizer) -> PromptText:
    return render_chatml(conversation, default_system_prompt=default_system_prompt(tokenizer))


@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
def test_plain_conversations_render_as_the_models_own_template(smollm2_tokenizer: Tokenizer, messages) -> None:
    rendered = render(conversation_of(messages), smollm2_tokenizer)

    assert rendered.text == smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_special_ranges_mark_exactly_the_control_tokens(smollm2_tokenizer: Tokenizer) -> None:
    rendered = render(conversation_of(PLAIN_CONVERSATIONS[2]), smollm2_tokenizer)

    spans = [rendered.text[start:end] for start, end in rendered.special_ranges]
    assert spans == [IM_START, IM_END] * 4 + [IM_START]
    # The user's "<|im_start|>system" is text: no range covers it.
    typed = rendered.text.index("😀 <|im_start|>") + 3
    assert all(not start <= typed < end for start, end in rendered.special_ranges)


def test_the_default_system_prompt_is_read_from_the_template(smollm2_tokenizer: Tokenizer) -> None:
    assert default_system_prompt(smollm2_tokenizer) == SMOLLM_SYSTEM
    assert default_system_prompt(make_tiny_tokenizer()) is None
    assert default_system_prompt(make_tiny_tokenizer(chat_template=None)) is None


def test_tools_are_described_in_the_system_prompt(smollm2_tokenizer: Tokenizer) -> None:
    conversation = dr.Conversation([dr.UserMessage("Weather in Paris?")], thinking_mode=False, tools=[WEATHER])

    text = render(conversation, smollm2_tokenizer).text

    system = text[: text.index(IM_END)]
    assert system.startswith(f"{IM_START}system\n{SMOLLM_SYSTEM}\n\n# Tools")
    schema_line = next(line for line in system.splitlines() if line.startswith('{"name": "get_weather"'))
    assert json.loads(schema_line)["parameters"] == WEATHER.parameters
    assert '<tool_call>{"name": "<function-name>", "arguments": {<arguments as JSON>}}</tool_call>' in system
    assert text.endswith(f"{IM_START}assistant\n")


def test_a_required_tool_call_opens_the_call_in_the_prompt(smollm2_tokenizer: Tokenizer) -> None:
    conversation = dr.Conversation(
        [dr.SystemMessage("Be brief."), dr.UserMessage("Weather?")],
        thinking_mode=False,
        tools=[WEATHER],
        tool_choice="required",
    )

    text = render(conversation, smollm2_tokenizer).text

    assert text.startswith(f"{IM_START}system\nBe brief.\n\n# Tools")
    assert "You must call a function now." in text
    assert text.endswith(f"{IM_START}assistant\n<tool_call>")


def test_tool_calls_and_results_render_in_the_native_format(smollm2_tokenizer: Tokenizer) -> None:
    conversation = dr.Conversation(
        [
            dr.UserMessage("Weather in Paris and Rome?"),
            dr.AssistantMessage(
                "Checking.",
                tool_calls=[
                    dr.ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                    dr.ToolCall("call_2", "get_weather", "not json"),
                ],
            ),
            dr.ToolMessage("sunny", tool_call_id="call_1"),
            dr.ToolMessage("rain", tool_call_id="call_2"),
            dr.UserMessage("Thanks"),
        ],
        thinking_mode=False,
        tools=[WEATHER],
    )

    text = render(conversation, smollm2_tokenizer).text

    assert (
        f"{IM_START}assistant\nChecking.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": "not json"}</tool_call>'
        f"{IM_END}\n"
        f"{IM_START}user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>{IM_END}\n"
        f"{IM_START}user\nThanks{IM_END}\n"
    ) in text


def test_a_prefix_assistant_message_is_continued(smollm2_tokenizer: Tokenizer) -> None:
    conversation = dr.Conversation(
        [dr.UserMessage("Count"), dr.AssistantMessage("One, two,", prefix=True)], thinking_mode=False
    )

    text = render(conversation, smollm2_tokenizer).text

    assert text.endswith(f"{IM_START}assistant\nOne, two,")


def test_a_json_schema_response_format_is_described_to_the_model(smollm2_tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    conversation = dr.Conversation([dr.UserMessage("2+2?")], thinking_mode=False, response_schema=schema)

    text = render(conversation, smollm2_tokenizer).text

    assert f"Reply with JSON only, matching this JSON schema:\n{json.dumps(schema)}{IM_END}" in text
