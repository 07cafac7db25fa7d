"""The DeepSeek V4.1 path, on a byte-level tokenizer that has DeepSeek's special tokens."""

import json
from pathlib import Path

import deepseek_recipe as dr
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from recipe.api import ServedModel, prepare_request
from recipe.prompt_encoding import encode_conversation
from recipe.served_model import prompt_family
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.messages import GenerateOutput
from workers.text.tokenizer import Tokenizer

SPECIALS = [
    token.default_str()
    for token in (
        dr.SpecialToken.Bos,
        dr.SpecialToken.Eos,
        dr.SpecialToken.User,
        dr.SpecialToken.Assistant,
        dr.SpecialToken.System,
        dr.SpecialToken.ThinkingStart,
        dr.SpecialToken.ThinkingEnd,
        dr.SpecialToken.LatestReminder,
        dr.SpecialToken.Dsml,
    )
]
EOS = 1
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def deepseek_like_tokenizer_json() -> str:
    """One token per byte plus DeepSeek V4.1's special tokens: enough to run its prompt encoding."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: token_id for token_id, token in enumerate([*SPECIALS, *byte_chars])}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    return backend.to_str()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    tokenizer_json = deepseek_like_tokenizer_json()
    tokenizer = Tokenizer(
        tokenizer_json=tokenizer_json,
        tokenizer_config={"bos_token": SPECIALS[0], "eos_token": SPECIALS[1]},
        generation_config={},
        chat_template=None,
        source=Path("deepseek-like/tokenizer.json"),
    )
    codec_tokenizer = dr.Tokenizer.from_str(tokenizer_json)
    return ServedModel("deepseek-like", tokenizer, prompt_family(tokenizer), 4096, codec_tokenizer)


def outputs_for(model: ServedModel, generated: str) -> list[GenerateOutput]:
    """What the engine sends: DSML spelled with its special tokens, one token per output, then EOS."""
    token_ids = [*model.tokenizer.encode(generated, allow_special=True), EOS]
    return [
        GenerateOutput(
            request_id="r",
            token_ids=[token_id],
            text="",  # unused: DeepSeek outputs are decoded by the library from the tokens
            logprobs=[TokenLogprobs(token_id, -0.5, 1, [(token_id, -0.5)])],
            finish_reason="stop" if position == len(token_ids) - 1 else None,
            num_prompt_tokens=30,
        )
        for position, token_id in enumerate(token_ids)
    ]


def test_the_model_is_recognised_by_its_special_tokens(model: ServedModel) -> None:
    assert model.family == "deepseek_v41"
    assert model.tokenizer.eos_token_ids == {EOS}


def test_prompts_are_encoded_by_the_library_and_typed_specials_stay_text(model: ServedModel) -> None:
    messages = [dr.SystemMessage("sys"), dr.UserMessage("hi <｜Assistant｜> there")]
    conversation = dr.Conversation(messages, thinking_mode=False)
    rendered = dr.DeepseekV41Encoding().render_conversation(conversation)

    ids = encode_conversation(conversation, model)

    assert len([token for token in ids if token in model.tokenizer.special_token_ids]) == len(rendered.special_ranges)
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == rendered.prompt


def test_a_dsml_tool_call_and_logprobs_from_tokens(model: ServedModel) -> None:
    body = {
        "model": "deepseek-like",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL],
        "logprobs": True,
        "top_logprobs": 1,
    }
    prepared = prepare_request("chat.completions", body, {"deepseek-like": model})
    generated = (
        'Sure.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    builder = prepared.new_response("chatcmpl-ds", 1)

    for output in outputs_for(model, generated):
        builder.push(0, output)
    body = builder.body()

    assert prepared.constraint is None  # no DSML grammar yet: tool calls are parsed, not enforced
    assert prepared.sampling_params(0).logprobs == 1
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Sure."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"
    assert "".join(entry["token"] for entry in choice["logprobs"]["content"]) == "Sure."
    assert body["usage"]["completion_tokens"] == len(model.tokenizer.encode(generated, allow_special=True)) + 1


def test_cache_breakpoints_on_text_are_placed_and_those_on_tools_keep_nothing(model: ServedModel) -> None:
    hour = {"type": "ephemeral", "ttl": "1h"}
    body = {
        "model": "deepseek-like",
        "max_tokens": 8,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}, "cache_control": hour}],
        "system": [{"type": "text", "text": "Be terse.", "cache_control": hour}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": hour}]}],
    }

    prepared = prepare_request("messages", body, {"deepseek-like": model})

    ids = prepared.prompt_token_ids
    prefixes = [
        model.tokenizer.decode(ids[: hint.prefix_tokens], skip_special_tokens=False) for hint in prepared.cache_hints
    ]
    assert len(prefixes) == 2  # the DeepSeek encoding does not say where a tool's definition ends
    assert prefixes[0].endswith("Be terse.") and prefixes[1].endswith("Weather?")
    assert model.tokenizer.decode(ids, skip_special_tokens=False).startswith(prefixes[1])
