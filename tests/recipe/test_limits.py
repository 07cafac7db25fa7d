"""Bounded inputs: every hostile value and every limit gets a 400 naming the field, on every endpoint
that takes it, before any work is done for the request."""

import deepseek_recipe as dr
import pytest

from recipe.api import ApiError, RequestLimits, ServedModel, count_tokens, prepare_request
from recipe.limits import field_name
from workers.protocol.errors import InvalidRequestError
from workers.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
USER = [{"role": "user", "content": "Hi"}]
CONVERSATIONS = ["chat.completions", "responses", "messages", "messages.count_tokens"]
ALL = ["completions", *CONVERSATIONS]
# Where each protocol keeps the prompt, its token budget and its tools.
PROMPT_FIELDS = {
    "chat.completions": "messages",
    "completions": "prompt",
    "responses": "input",
    "messages": "messages",
    "messages.count_tokens": "messages",
}
MAX_TOKENS_FIELDS = {"chat.completions": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Tokenizer, smollm2_files) -> dict[str, ServedModel]:
    codec_tokenizer = dr.Tokenizer.from_file(str(smollm2_files.tokenizer_file))
    return {MODEL: ServedModel(MODEL, smollm2_tokenizer, "chatml", 2048, codec_tokenizer)}


def body(protocol: str, **fields) -> dict:
    bodies = {
        "chat.completions": {"messages": USER, "max_tokens": 4},
        "completions": {"prompt": "Hi", "max_tokens": 4},
        "responses": {"input": "Hi", "max_output_tokens": 4},
        "messages": {"messages": USER, "max_tokens": 4},
        "messages.count_tokens": {"messages": USER},
    }
    return {"model": MODEL, **bodies[protocol], **fields}


def submit(protocol: str, request: dict, models: dict, limits: RequestLimits = RequestLimits()) -> object:
    if protocol == "messages.count_tokens":
        return count_tokens(request, models, limits)
    return prepare_request(protocol, request, models, limits)


def refusal(protocol: str, request: dict, models: dict, limits: RequestLimits = RequestLimits()) -> ApiError:
    with pytest.raises(ApiError) as refused:
        submit(protocol, request, models, limits)
    assert (refused.value.status, refused.value.type) == (400, "invalid_request_error")
    assert refused.value.param and f"`{refused.value.param}`" in refused.value.message, refused.value
    return refused.value


def nested_list(depth: int, leaf: object = "hi") -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def nested_schema(depth: int) -> dict:
    """An object schema of `depth` levels of properties: 2 levels of JSON nesting each."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(protocol: str, schema: dict) -> dict:
    if protocol.startswith("messages"):
        return {"name": "f", "input_schema": schema}
    if protocol == "responses":
        return {"type": "function", "name": "f", "parameters": schema}
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


def schema_field(protocol: str) -> str:
    return {"chat.completions": "tools[0].function.parameters", "responses": "tools[0].parameters"}.get(
        protocol, "tools[0].input_schema"
    )


def message_with(protocol: str, content: object) -> dict:
    if protocol == "completions":
        return {"prompt": content}
    if protocol == "responses":
        return {"input": [{"role": "user", "content": content}]}
    return {"messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("protocol", ALL)
@pytest.mark.parametrize("value", [10**30, -(10**30), 2**64])
def test_an_integer_past_64_bits_anywhere_is_refused(models, protocol, value):
    refused = refusal(protocol, body(protocol, metadata={"tag": value}), models)

    assert refused.param == "metadata.tag" and "64-bit" in refused.message


@pytest.mark.parametrize("protocol", ["chat.completions", "completions", "responses", "messages"])
def test_a_giant_token_count_is_refused(models, protocol):
    field = MAX_TOKENS_FIELDS.get(protocol, "max_tokens")

    for value in [10**30, 2**63, 2**40, 2049]:  # past 64 bits, past the library's u32, past the window
        assert refusal(protocol, body(protocol, **{field: value}), models).param == field


def test_max_completion_tokens_is_bounded_under_its_own_name(models):
    for value in [10**30, 2**40, 0]:
        refused = refusal("chat.completions", body("chat.completions", max_completion_tokens=value), models)
        assert refused.param == "max_completion_tokens"


@pytest.mark.parametrize("protocol", ["chat.completions", "completions", "responses", "messages"])
@pytest.mark.parametrize("value", [-1, 10**20, 1.5, "3"])
def test_a_negative_or_giant_top_k_is_refused(models, protocol, value):
    assert refusal(protocol, body(protocol, top_k=value), models).param == "top_k"


@pytest.mark.parametrize("protocol", ["chat.completions", "completions", "responses", "messages"])
def test_top_k_past_the_vocabulary_means_no_top_k(models, protocol):
    small = submit(protocol, body(protocol, top_k=40), models)
    whole_vocabulary = submit(protocol, body(protocol, top_k=2**63), models)

    assert (small.params.top_k, whole_vocabulary.params.top_k) == (40, 0)


@pytest.mark.parametrize("protocol", ["chat.completions", "completions"])
def test_seeds_take_openais_64_bit_range_and_nothing_past_it(models, protocol):
    lowest = submit(protocol, body(protocol, seed=-(2**63), n=2), models)
    highest = submit(protocol, body(protocol, seed=2**63 - 1, n=2), models)

    assert [lowest.sampling_params(choice).seed for choice in range(2)] == [-(2**63), -(2**63) + 1]
    assert highest.sampling_params(1).seed == 2**63
    for value in [2**63, -(2**63) - 1, 2**70, -(2**70)]:
        assert refusal(protocol, body(protocol, seed=value), models).param == "seed"


@pytest.mark.parametrize("protocol", ["chat.completions", "completions"])
def test_n_is_bounded(models, protocol):
    assert refusal(protocol, body(protocol, n=10**30), models).param == "n"
    assert refusal(protocol, body(protocol, n=3), models, RequestLimits(max_choices=2)).param == "n"


@pytest.mark.parametrize("protocol", ["chat.completions", "completions", "responses", "messages"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**400])
def test_a_number_that_is_not_finite_is_refused(models, protocol, value):
    refused = refusal(protocol, body(protocol, temperature=value), models)

    assert refused.param == "temperature"


@pytest.mark.parametrize("protocol", ["chat.completions", "responses", "messages", "messages.count_tokens"])
def test_content_nested_900_deep_is_refused(models, protocol):
    refused = refusal(protocol, body(protocol, **message_with(protocol, nested_list(900))), models)

    assert refused.param.startswith(PROMPT_FIELDS[protocol]) and "deep" in refused.message


@pytest.mark.parametrize("protocol", CONVERSATIONS)
def test_a_tool_schema_nested_200_deep_is_refused(models, protocol):
    refused = refusal(protocol, body(protocol, tools=[tool(protocol, nested_schema(200))]), models)

    assert refused.param.startswith(schema_field(protocol))


@pytest.mark.parametrize("protocol", CONVERSATIONS)
def test_a_schema_past_its_own_depth_is_refused_within_the_bodys(models, protocol):
    # 20 levels of properties: 41 levels of JSON, past the schema's 32 but not the body's 64
    refused = refusal(protocol, body(protocol, tools=[tool(protocol, nested_schema(20))]), models)

    assert refused.param == schema_field(protocol)
    assert submit(protocol, body(protocol, tools=[tool(protocol, nested_schema(10))]), models)


@pytest.mark.parametrize("protocol", CONVERSATIONS)
def test_a_schema_past_its_size_is_refused(models, protocol):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}}

    refused = refusal(
        protocol, body(protocol, tools=[tool(protocol, schema)]), models, RequestLimits(max_schema_bytes=500)
    )

    assert refused.param == schema_field(protocol) and "bytes" in refused.message


def test_response_format_schemas_and_regexes_are_bounded(models):
    deep = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(20)}}
    long_regex = {"type": "regex", "regex": "a" * 600}
    small = RequestLimits(max_schema_bytes=500)

    assert refusal("chat.completions", body("chat.completions", response_format=deep), models).param == (
        "response_format.json_schema.schema"
    )
    assert refusal("chat.completions", body("chat.completions", response_format=long_regex), models, small).param == (
        "response_format.regex"
    )
    text_format = {"format": {"type": "json_schema", "name": "x", "schema": nested_schema(20)}}
    assert refusal("responses", body("responses", text=text_format), models).param == "text.format.schema"


@pytest.mark.parametrize("protocol", ["chat.completions", "completions"])
@pytest.mark.parametrize("key", ["²", "١", "1" * 5000, "-1", " 1", "1.0"])
def test_a_logit_bias_key_that_is_not_an_ascii_token_id_is_refused(models, protocol, key):
    assert refusal(protocol, body(protocol, logit_bias={key: 1}), models).param == "logit_bias"


@pytest.mark.parametrize("protocol", ["chat.completions", "completions"])
def test_logit_bias_entries_are_bounded(models, protocol):
    biases = {str(token_id): 1 for token_id in range(5)}

    refused = refusal(protocol, body(protocol, logit_bias=biases), models, RequestLimits(max_logit_bias=4))

    assert refused.param == "logit_bias"


@pytest.mark.parametrize("protocol", ALL)
def test_a_lone_surrogate_in_the_prompt_is_refused(models, protocol):
    content = "hi \ud800 there"
    prompt = {"prompt": content} if protocol == "completions" else message_with(protocol, content)
    if protocol == "responses":
        prompt = {"input": content}

    refused = refusal(protocol, body(protocol, **prompt), models)

    assert refused.param.startswith(PROMPT_FIELDS[protocol]) and "UTF-8" in refused.message


@pytest.mark.parametrize("protocol", ALL)
def test_a_lone_surrogate_in_a_key_or_a_nested_string_is_refused(models, protocol):
    in_key = refusal(protocol, body(protocol, metadata={"\udfff": "x"}), models)
    nested = refusal(protocol, body(protocol, metadata={"tags": ["ok", "\udc80\udcff"]}), models)

    assert in_key.param == 'metadata["\\udfff"]'
    assert nested.param == "metadata.tags[1]"


@pytest.mark.parametrize(
    ("protocol", "field"), [("chat.completions", "stop"), ("completions", "stop"), ("messages", "stop_sequences")]
)
def test_stop_sequences_are_bounded(models, protocol, field):
    surrogate = refusal(protocol, body(protocol, **{field: ["ok", "\ud800"]}), models)
    too_many = refusal(protocol, body(protocol, **{field: [f"s{i}" for i in range(17)]}), models)
    too_long = refusal(protocol, body(protocol, **{field: ["x" * 257]}), models)
    over_setting = refusal(
        protocol, body(protocol, **{field: ["a", "b", "c"]}), models, RequestLimits(max_stop_sequences=2)
    )

    assert surrogate.param == f"{field}[1]"
    assert too_many.param == too_long.param == over_setting.param == field


@pytest.mark.parametrize("protocol", CONVERSATIONS)
def test_messages_tools_and_content_parts_are_counted(models, protocol):
    limits = RequestLimits(max_messages=2, max_tools=1, max_content_parts=2)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    field = PROMPT_FIELDS[protocol]
    parts = [{"type": "input_text" if protocol == "responses" else "text", "text": "a"}] * 3

    assert refusal(protocol, body(protocol, **{field: messages}), models, limits).param == field
    assert refusal(protocol, body(protocol, tools=[tool(protocol, {"type": "object"})] * 2), models, limits).param == (
        "tools"
    )
    assert refusal(protocol, body(protocol, **message_with(protocol, parts)), models, limits).param == (
        f"{field}[0].content"
    )


def test_anthropics_system_blocks_are_counted_as_content(models):
    system = [{"type": "text", "text": "be brief"}] * 3

    refused = refusal("messages", body("messages", system=system), models, RequestLimits(max_content_parts=2))

    assert refused.param == "system"


def test_messages_needs_max_tokens_and_count_tokens_does_not(models):
    without = {"model": MODEL, "messages": USER}

    assert refusal("messages", without, models).param == "max_tokens"
    assert count_tokens(without, models) > 0


@pytest.mark.parametrize(
    ("protocol", "fields", "param"),
    [
        ("chat.completions", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ("chat.completions", {"messages": [{"role": 5, "content": "x"}]}, "messages"),
        ("responses", {"instructions": 5}, "instructions"),
        ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
        ("messages", {"system": 5}, "system"),
        # Refusals of fields it could read, whose messages name no field (found by bench.fuzz_api):
        ("chat.completions", {"tools": [tool("chat.completions", {"type": "object"})] * 2}, "tools"),
        ("responses", {"tools": [tool("responses", {"type": "object"})] * 2}, "tools"),
        ("messages", {"tools": [tool("messages", {})]}, "tools"),
        ("chat.completions", {"messages": []}, "messages"),
        ("responses", {"input": []}, "input"),
        ("messages", {"messages": []}, "messages"),
        ("chat.completions", {"response_format": {"type": "json_object"}}, "messages"),
        ("responses", {"text": {"format": {"type": "json_object"}}}, "input"),
        ("chat.completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat.completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages"),
        ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input"),
        ("chat.completions", {"messages": [{"role": "assistant", "content": None}, *USER]}, "messages"),
        (
            "chat.completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format",
        ),
        (
            "responses",
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
            "text.format",
        ),
        (
            "responses",
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}] * 2},
            "input",
        ),
        (
            "chat.completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "user", "content": "Hi"},
                ]
            },
            "messages",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]},
            "messages",
        ),
    ],
)
def test_the_librarys_refusals_name_their_field(models, protocol, fields, param):
    assert refusal(protocol, body(protocol, **fields), models).param == param


def test_limits_are_checked_when_made():
    for bad in [{"max_json_depth": 0}, {"max_json_depth": 128}, {"max_stop_sequences": 17}, {"max_tools": -1}]:
        with pytest.raises(ValueError):
            RequestLimits(**bad)


def test_field_names_read_as_paths():
    assert field_name(("messages", 3, "content", 0, "text")) == "messages[3].content[0].text"
    assert field_name(("logit_bias", "12")) == 'logit_bias["12"]'


def test_the_tokenizer_refuses_text_that_is_not_unicode(smollm2_tokenizer):
    with pytest.raises(InvalidRequestError):
        smollm2_tokenizer.encode("a\ud800b")
