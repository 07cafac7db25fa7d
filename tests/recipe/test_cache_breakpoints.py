"""Where a cache breakpoint ends in the prompt: the hint covers exactly the prompt's tokens up to the
end of its block as the ChatML encoding renders it (the real SmolLM2 tokenizer)."""

import deepseek_recipe as dr
import pytest

from recipe.api import PreparedRequest, ServedModel, prepare_request
from workers.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
HOUR = {"type": "ephemeral", "ttl": "1h"}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Tokenizer, smollm2_files) -> dict[str, ServedModel]:
    codec_tokenizer = dr.Tokenizer.from_file(str(smollm2_files.tokenizer_file))
    return {MODEL: ServedModel(MODEL, smollm2_tokenizer, "chatml", 2048, codec_tokenizer)}


def conversation() -> dict:
    """A tool round trip with two of everything that can carry a breakpoint."""
    return {
        "model": MODEL,
        "max_tokens": 8,
        "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}],
        "tools": [
            {"name": "get_weather", "description": "Weather", "input_schema": CITY_SCHEMA},
            {"name": "get_time", "input_schema": {"type": "object"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Be brief."}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get_time", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "noon"}]},
                    {"type": "text", "text": "Thanks!"},
                ],
            },
        ],
    }


def with_breakpoint(request: dict, *path: str | int) -> dict:
    """`request` with a 1h cache_control on the object at `path`."""
    target = request
    for key in path:
        target = target[key]
    target["cache_control"] = HOUR
    return request


def split_at_hint(prepared: PreparedRequest, tokenizer: Tokenizer) -> tuple[str, str]:
    """The prompt's text before and after the one hint's prefix."""
    [hint] = prepared.cache_hints
    ids = prepared.prompt_token_ids
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False)  # noqa: E731
    return decode(ids[: hint.prefix_tokens]), decode(ids[hint.prefix_tokens :])


@pytest.mark.parametrize(
    ("path", "ends_with", "then"),
    [
        (("system", 0), "<|im_start|>system\nYou are terse.", "\n\nAnswer in English."),
        (("system", 1), "You are terse.\n\nAnswer in English.", "\n\n# Tools"),
        (("tools", 0), '"properties": {"city": {"type": "string"}}}}', '\n{"name": "get_time"'),
        (("tools", 1), '{"name": "get_time", "description": "", "parameters": {"type": "object"}}', "\n</tools>"),
        (
            ("messages", 0, "content", 0),
            "<|im_start|>user\nWeather in Paris?",
            "<|im_end|>\n<|im_start|>user\nBe brief.",
        ),
        (("messages", 0, "content", 1), "user\nBe brief.", "<|im_end|>\n<|im_start|>assistant\nChecking."),
        (("messages", 1, "content", 0), "assistant\nChecking.", '\n<tool_call>{"name": "get_weather"'),
        (
            ("messages", 1, "content", 1),
            '"arguments": {"city": "Paris"}}</tool_call>',
            '\n<tool_call>{"name": "get_time"',
        ),
        (
            ("messages", 1, "content", 2),
            '"arguments": {}}</tool_call>',
            "<|im_end|>\n<|im_start|>user\n<tool_response>",
        ),
        (("messages", 2, "content", 0), "<tool_response>\nsunny", "\n</tool_response>\n<tool_response>\nnoon"),
        (("messages", 2, "content", 1), "<tool_response>\nnoon", "\n</tool_response><|im_end|>"),
        (("messages", 2, "content", 1, "content", 0), "<tool_response>\nnoon", "\n</tool_response><|im_end|>"),
        (("messages", 2, "content", 2), "<|im_start|>user\nThanks!", "<|im_end|>\n<|im_start|>assistant\n"),
        ((), "<|im_start|>user\nThanks!", "<|im_end|>\n<|im_start|>assistant\n"),
    ],
    ids=[
        "system-block",
        "last-system-block",
        "tool",
        "last-tool",
        "text-block",
        "second-text-block",
        "assistant-text",
        "tool-use",
        "last-tool-use",
        "tool-result",
        "tool-result-blocks",
        "inside-a-tool-result",
        "last-block",
        "top-level",
    ],
)
def test_a_breakpoint_covers_the_prompt_up_to_the_end_of_its_block(models, smollm2_tokenizer, path, ends_with, then):
    request = with_breakpoint(conversation(), *path)

    before, after = split_at_hint(prepare_request("messages", request, models), smollm2_tokenizer)

    assert before.endswith(ends_with)
    assert after.startswith(then)


def test_a_tool_result_without_content_ends_inside_its_tags(models, smollm2_tokenizer) -> None:
    request = conversation()
    request["messages"][2]["content"][0] = {"type": "tool_result", "tool_use_id": "t1", "cache_control": HOUR}

    before, after = split_at_hint(prepare_request("messages", request, models), smollm2_tokenizer)

    assert before.endswith("<tool_response>\n") and after.startswith("\n</tool_response>")


def test_text_that_holds_a_would_be_marker_is_placed_all_the_same(models, smollm2_tokenizer) -> None:
    request = conversation()
    request["system"][0]["text"] = "You are terse \ue000\ue001."
    with_breakpoint(request, "system", 0)

    before, after = split_at_hint(prepare_request("messages", request, models), smollm2_tokenizer)

    assert before.endswith("You are terse \ue000\ue001.") and after.startswith("\n\nAnswer")


def test_a_string_message_under_a_top_level_breakpoint(models, smollm2_tokenizer) -> None:
    request = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi there."}]}
    request["cache_control"] = {"type": "ephemeral"}

    prepared = prepare_request("messages", request, models)
    before, after = split_at_hint(prepared, smollm2_tokenizer)

    assert prepared.cache_hints[0].retain_s == 300.0
    assert before.endswith("user\nHi there.") and after == "<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("protocol", "items_field", "part_type"),
    [("chat.completions", "messages", "text"), ("responses", "input", "input_text")],
)
def test_an_openai_breakpoint_covers_the_prompt_up_to_the_end_of_its_part(
    models, smollm2_tokenizer, protocol, items_field, part_type
):
    parts = [
        {"type": part_type, "text": "First part.", "prompt_cache_breakpoint": {"mode": "explicit"}},
        {"type": part_type, "text": "Second part."},
    ]
    request = {"model": MODEL, items_field: [{"role": "user", "content": parts}]}

    before, after = split_at_hint(prepare_request(protocol, request, models), smollm2_tokenizer)

    assert before.endswith("user\nFirst part.")
    assert "Second part." in after and "First part." not in after
