"""Clients' cache hints read from each API's body: valid ones become engine hints and a cache key,
invalid ones a 400 naming the field, before any work is done for the request."""

import deepseek_recipe as dr
import pytest

from recipe.api import ApiError, ServedModel, count_tokens, prepare_request
from recipe.limits import RequestLimits
from workers.protocol.messages import CacheHint
from workers.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello."}]
HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE_MINUTES = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Tokenizer, smollm2_files) -> dict[str, ServedModel]:
    codec_tokenizer = dr.Tokenizer.from_file(str(smollm2_files.tokenizer_file))
    return {MODEL: ServedModel(MODEL, smollm2_tokenizer, "chatml", 2048, codec_tokenizer)}


def body(protocol: str, **fields) -> dict:
    bodies = {
        "chat.completions": {"messages": HELLO},
        "completions": {"prompt": "Hello,"},
        "responses": {"input": "Say hello."},
        "messages": {"messages": HELLO, "max_tokens": 4},
    }
    return {"model": MODEL, **bodies[protocol], **fields}


def text(content: str, cache_control: dict | None = None) -> dict:
    block = {"type": "text", "text": content}
    return block if cache_control is None else {**block, "cache_control": cache_control}


def refusal(protocol: str, request: dict, models: dict, limits: RequestLimits = RequestLimits()) -> ApiError:
    with pytest.raises(ApiError) as refused:
        prepare_request(protocol, request, models, limits)
    assert refused.value.status == 400 and f"`{refused.value.param}" in refused.value.message
    return refused.value


OPENAI = ["chat.completions", "responses", "completions"]


@pytest.mark.parametrize("protocol", OPENAI)
def test_prompt_cache_retention_24h_keeps_the_whole_prompt_for_a_day(models, protocol) -> None:
    prepared = prepare_request(protocol, body(protocol, prompt_cache_retention="24h"), models)

    assert prepared.cache_hints == (CacheHint(prefix_tokens=len(prepared.prompt_token_ids), retain_s=86400.0),)


@pytest.mark.parametrize("protocol", OPENAI)
def test_in_memory_retention_and_no_hint_keep_nothing_beyond_the_default(models, protocol) -> None:
    assert prepare_request(protocol, body(protocol, prompt_cache_retention="in_memory"), models).cache_hints == ()
    assert prepare_request(protocol, body(protocol), models).cache_hints == ()


@pytest.mark.parametrize("protocol", OPENAI)
def test_prompt_cache_key_is_read_and_an_empty_one_is_none(models, protocol) -> None:
    assert prepare_request(protocol, body(protocol, prompt_cache_key="user-42"), models).prompt_cache_key == "user-42"
    assert prepare_request(protocol, body(protocol, prompt_cache_key=""), models).prompt_cache_key is None


@pytest.mark.parametrize("protocol", OPENAI)
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt_cache_key": 42}, "prompt_cache_key"),
        ({"prompt_cache_key": "k" * 65}, "prompt_cache_key"),
        ({"prompt_cache_retention": "48h"}, "prompt_cache_retention"),
        ({"prompt_cache_retention": ["24h"]}, "prompt_cache_retention"),
    ],
    ids=["key-not-a-string", "key-too-long", "unknown-retention", "retention-not-a-string"],
)
def test_invalid_openai_hints_are_refused_naming_the_field(models, protocol, fields, param) -> None:
    assert refusal(protocol, body(protocol, **fields), models).param == param


def test_the_key_length_is_a_request_limit(models) -> None:
    limits = RequestLimits(max_prompt_cache_key_chars=8)
    request = body("chat.completions", prompt_cache_key="123456789")

    assert refusal("chat.completions", request, models, limits).param == "prompt_cache_key"


def test_anthropic_breakpoints_become_hints_in_prefix_order(models) -> None:
    tools = [{"name": "lookup", "input_schema": {"type": "object"}, "cache_control": HOUR}]
    request = body(
        "messages",
        tools=tools,
        system=[text("You are terse.", FIVE_MINUTES)],
        messages=[{"role": "user", "content": [text("Say hello.", FIVE_MINUTES)]}],
    )

    prepared = prepare_request("messages", request, models)

    # ChatML renders the system text before the tools, so the 5m system breakpoint keeps the shortest prefix.
    retain = [hint.retain_s for hint in prepared.cache_hints]
    prefixes = [hint.prefix_tokens for hint in prepared.cache_hints]
    assert retain == [3600.0, 300.0, 300.0]
    assert prefixes[1] < prefixes[0] < prefixes[2] < len(prepared.prompt_token_ids)


def messages_refusal(models, **fields) -> ApiError:
    return refusal("messages", body("messages", **fields), models)


@pytest.mark.parametrize(
    ("cache_control", "param"),
    [
        ("ephemeral", "messages[0].content[0].cache_control"),
        ({"type": "persistent"}, "messages[0].content[0].cache_control.type"),
        ({"ttl": "5m"}, "messages[0].content[0].cache_control.type"),
        ({"type": "ephemeral", "ttl": "2h"}, "messages[0].content[0].cache_control.ttl"),
        ({"type": "ephemeral", "ttl": 300}, "messages[0].content[0].cache_control.ttl"),
        ({"type": "ephemeral", "scope": "global"}, "messages[0].content[0].cache_control.scope"),
    ],
    ids=["not-an-object", "wrong-type", "no-type", "unknown-ttl", "numeric-ttl", "unknown-field"],
)
def test_an_invalid_cache_control_is_refused_naming_the_field(models, cache_control, param) -> None:
    refused = messages_refusal(models, messages=[{"role": "user", "content": [text("Hi.", cache_control)]}])

    assert refused.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"system": [text("Be kind.", {"type": "ephemeral", "ttl": "1d"})]}, "system[0].cache_control.ttl"),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "x"}}]},
            "tools[0].cache_control.type",
        ),
        ({"cache_control": {"type": "ephemeral", "ttl": "10m"}}, "cache_control.ttl"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [text("r", {"type": 1})]}],
                    }
                ]
            },
            "messages[0].content[0].content[0].cache_control.type",
        ),
    ],
    ids=["system", "tool", "top-level", "inside-a-tool-result"],
)
def test_cache_control_is_checked_wherever_it_may_be(models, fields, param) -> None:
    assert messages_refusal(models, **fields).param == param


def test_at_most_four_breakpoints(models) -> None:
    content = [text(f"Part {index}.", FIVE_MINUTES) for index in range(5)]

    refused = messages_refusal(models, messages=[{"role": "user", "content": content}])

    assert refused.param == "messages[0].content[4].cache_control" and "at most 4" in refused.message
    four = body("messages", messages=[{"role": "user", "content": content[:4]}])
    assert len(prepare_request("messages", four, models).cache_hints) == 4


def test_the_top_level_cache_control_counts_unless_the_last_block_has_its_own(models) -> None:
    content = [text(f"Part {index}.", FIVE_MINUTES) for index in range(4)] + [text("Last.")]
    over = messages_refusal(models, messages=[{"role": "user", "content": content}], cache_control=FIVE_MINUTES)
    assert over.param == "cache_control"

    content[-1] = text("Last.", FIVE_MINUTES)
    content.pop(0)
    request = body("messages", messages=[{"role": "user", "content": content}], cache_control=FIVE_MINUTES)
    assert len(prepare_request("messages", request, models).cache_hints) == 4


def test_a_1h_breakpoint_may_not_follow_a_5m_one(models) -> None:
    refused = messages_refusal(
        models,
        system=[text("Be kind.", FIVE_MINUTES)],
        messages=[{"role": "user", "content": [text("Hi.", HOUR)]}],
    )

    assert refused.param == "messages[0].content[0].cache_control" and '"1h"' in refused.message
    # Tools come first in Anthropic's order, though ChatML renders them after the system text.
    fine = body(
        "messages",
        tools=[{"name": "f", "input_schema": {"type": "object"}, "cache_control": HOUR}],
        system=[text("Be kind.", FIVE_MINUTES)],
    )
    assert len(prepare_request("messages", fine, models).cache_hints) == 2


def test_count_tokens_checks_breakpoints_and_counts_the_same(models) -> None:
    plain = {"model": MODEL, "system": [text("Be kind.")], "messages": HELLO}
    hinted = {**plain, "system": [text("Be kind.", HOUR)], "cache_control": FIVE_MINUTES}

    assert count_tokens(hinted, models) == count_tokens(plain, models)
    with pytest.raises(ApiError) as refused:
        count_tokens({**plain, "cache_control": {"type": "ephemeral", "ttl": "1w"}}, models)
    assert refused.value.status == 400 and refused.value.param == "cache_control.ttl"


EXPLICIT = {"mode": "explicit"}


def chat_parts(*breakpoints: dict | None) -> list[dict]:
    """One user message whose text parts carry these prompt_cache_breakpoints (None: none)."""
    parts = []
    for index, breakpoint in enumerate(breakpoints):
        part = {"type": "text", "text": f"Part {index}."}
        parts.append(part if breakpoint is None else {**part, "prompt_cache_breakpoint": breakpoint})
    return [{"role": "user", "content": parts}]


def parts_of(kind: str, count: int) -> list[dict]:
    return [{"type": kind, "text": f"Part {index}.", "prompt_cache_breakpoint": EXPLICIT} for index in range(count)]


def test_openai_explicit_breakpoints_take_their_ttl_or_the_requests(models) -> None:
    request = body(
        "chat.completions",
        messages=chat_parts(EXPLICIT, {"mode": "explicit", "ttl": "12h"}, None),
        prompt_cache_options={"ttl": "30m"},
    )

    prepared = prepare_request("chat.completions", request, models)

    assert [hint.retain_s for hint in prepared.cache_hints] == [1800.0, 43200.0]
    assert prepared.cache_hints[0].prefix_tokens < prepared.cache_hints[1].prefix_tokens


@pytest.mark.parametrize(("mode", "kept"), [(None, 3), ("implicit", 3), ("explicit", 4)])
def test_openai_writes_the_latest_breakpoints_of_a_request(models, mode, kept) -> None:
    options = {} if mode is None else {"prompt_cache_options": {"mode": mode}}
    request = body("responses", input=[{"role": "user", "content": parts_of("input_text", 6)}], **options)

    prepared = prepare_request("responses", request, models)

    # The latest: the last hint covers the most, the last part.
    explicit = prepare_request("responses", {**request, "prompt_cache_options": {"mode": "explicit"}}, models)
    assert len(prepared.cache_hints) == kept
    assert prepared.cache_hints == explicit.cache_hints[-kept:]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": chat_parts("explicit")}, "messages[0].content[0].prompt_cache_breakpoint"),
        ({"messages": chat_parts({"ttl": "30m"})}, "messages[0].content[0].prompt_cache_breakpoint.mode"),
        ({"messages": chat_parts({"mode": "implicit"})}, "messages[0].content[0].prompt_cache_breakpoint.mode"),
        (
            {"messages": chat_parts({"mode": "explicit", "ttl": "1h"})},
            "messages[0].content[0].prompt_cache_breakpoint.ttl",
        ),
        ({"messages": chat_parts({"mode": "explicit", "x": 1})}, "messages[0].content[0].prompt_cache_breakpoint.x"),
        ({"prompt_cache_options": "explicit"}, "prompt_cache_options"),
        ({"prompt_cache_options": {"mode": "manual"}}, "prompt_cache_options.mode"),
        ({"prompt_cache_options": {"ttl": "1d"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"retention": "24h"}}, "prompt_cache_options.retention"),
    ],
    ids=[
        "breakpoint-not-an-object",
        "breakpoint-without-mode",
        "breakpoint-not-explicit",
        "breakpoint-unknown-ttl",
        "breakpoint-unknown-field",
        "options-not-an-object",
        "options-unknown-mode",
        "options-unknown-ttl",
        "options-unknown-field",
    ],
)
def test_invalid_openai_breakpoints_and_options_are_refused_naming_the_field(models, fields, param) -> None:
    assert refusal("chat.completions", body("chat.completions", **fields), models).param == param
