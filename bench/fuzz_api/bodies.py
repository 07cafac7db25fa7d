"""Request bodies for the fuzzer: valid ones for each endpoint (cheap to serve: a few tokens at most),
the same with one field made hostile, and the hostile values themselves."""

from hypothesis import strategies as st

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 8192
ENDPOINTS = {
    "models": ("GET", "/v1/models"),
    "chat.completions": ("POST", "/v1/chat/completions"),
    "completions": ("POST", "/v1/completions"),
    "responses": ("POST", "/v1/responses"),
    "messages": ("POST", "/v1/messages"),
    "messages.count_tokens": ("POST", "/v1/messages/count_tokens"),
}
TOKEN_BUDGET_FIELDS = {
    "chat.completions": "max_tokens",
    "completions": "max_tokens",
    "responses": "max_output_tokens",
    "messages": "max_tokens",
}
# Fields whose valid values cost engine work in proportion: a hostile value for one of them is drawn
# from those that are refused, or that stay cheap.
COSTLY_FIELDS = {"max_tokens", "max_output_tokens", "max_completion_tokens", "n"}

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
surrogate_text = st.builds(
    lambda before, surrogate, after: before + surrogate + after,
    st.text(max_size=5),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.text(max_size=5),
)


def nested(depth: int, leaf: object, as_object: bool) -> object:
    for _ in range(depth):
        leaf = {"a": leaf} if as_object else [leaf]
    return leaf


deep_values = st.builds(nested, st.integers(min_value=30, max_value=1000), json_scalars, st.booleans())
hostile_values = st.one_of(
    st.sampled_from(
        [10**30, -(10**30), 2**64, 2**63, -(2**63) - 1, 10**20, -1, 0, 1.5, -0.0, 1e308, "", "²", "١", None, True]
    ),
    st.sampled_from([[], {}, [[]], {"": None}, "x" * 5000, ["a"] * 40, {str(i): 1 for i in range(40)}]),
    surrogate_text,
    deep_values,
    json_values,
)
# A hostile value for a field that costs work when valid: refused, or cheap (None means the default,
# which for a token budget is the whole context window).
costly_field_values = hostile_values.filter(
    lambda value: (
        value is not None
        and not (isinstance(value, int) and not isinstance(value, bool) and 5 <= value <= MAX_MODEL_LEN)
    )
)
short_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=30)
tiny_schema = st.sampled_from(
    [{"type": "object"}, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}]
)
# Output formats, some of whose grammars do not compile ("((" is no regex, "bogus" no type): the
# workers refuse those, and the refusal must be a 400 that names the field.
output_schema = tiny_schema | st.sampled_from([{"type": "string", "pattern": "(("}, {"type": "bogus"}])
chat_response_format = st.one_of(
    st.just({"type": "json_object"}),
    output_schema.map(lambda schema: {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}),
    st.sampled_from(["(yes|no)", "[0-9]+", "(("]).map(lambda regex: {"type": "regex", "regex": regex}),
)
responses_text_format = output_schema.map(
    lambda schema: {"format": {"type": "json_schema", "name": "out", "schema": schema}}
)


def _chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# Conversations of the shapes each API documents: roles, content parts, tool calls and their results,
# with tool-call arguments that may not be JSON. They end with a user turn, as a client's would.
tool_arguments = st.sampled_from(['{"city": "Paris"}', "{}", "not json", '{"a": [1, {"b": null}]}', ""])
chat_parts = st.lists(
    st.one_of(
        short_text.map(lambda text: {"type": "text", "text": text}),
        st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}),
        st.just({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
    ),
    min_size=1,
    max_size=3,
)
chat_turn = st.one_of(
    st.builds(lambda content: {"role": "system", "content": content}, short_text),
    st.builds(lambda content: {"role": "user", "content": content}, short_text | chat_parts),
    st.builds(lambda content: {"role": "assistant", "content": content}, short_text | st.none()),
    st.builds(
        lambda arguments: {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}],
        },
        tool_arguments,
    ),
    st.builds(lambda content: {"role": "tool", "tool_call_id": "call_1", "content": content}, short_text),
)
anthropic_block = st.one_of(
    short_text.map(lambda text: {"type": "text", "text": text}),
    st.builds(
        lambda arguments: {"type": "tool_use", "id": "toolu_1", "name": "f", "input": arguments},
        st.dictionaries(st.text(max_size=5), json_scalars, max_size=2),
    ),
    st.builds(lambda text: {"type": "tool_result", "tool_use_id": "toolu_1", "content": text}, short_text),
    st.builds(lambda text: {"type": "thinking", "thinking": text, "signature": "x"}, short_text),
    st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}),
)
anthropic_turn = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["user", "assistant"]),
    short_text | st.lists(anthropic_block, min_size=1, max_size=3),
)
responses_item = st.one_of(
    st.builds(lambda text: {"role": "user", "content": text}, short_text),
    st.builds(lambda text: {"role": "user", "content": [{"type": "input_text", "text": text}]}, short_text),
    st.builds(
        lambda text: {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
        short_text,
    ),
    st.builds(
        lambda arguments: {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": arguments},
        tool_arguments,
    ),
    st.builds(lambda text: {"type": "function_call_output", "call_id": "call_1", "output": text}, short_text),
)


def _ending_with_user(turns: list[dict], last: str) -> list[dict]:
    return [*turns, {"role": "user", "content": last}]


def conversations(protocol: str) -> st.SearchStrategy[list[dict]]:
    turns = {"chat.completions": chat_turn, "responses": responses_item}.get(protocol, anthropic_turn)
    return st.builds(_ending_with_user, st.lists(turns, max_size=4), short_text)


def _optional(**fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=fields)


def valid_body(protocol: str) -> st.SearchStrategy[dict]:
    budget = st.integers(min_value=1, max_value=4)
    common = {
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0.01, max_value=1),
        "top_k": st.integers(min_value=0, max_value=2**63),
        "stream": st.booleans(),
    }
    if protocol == "chat.completions":
        messages = short_text.map(_chat_messages) | conversations(protocol)
        required = {"model": st.just(MODEL), "messages": messages, "max_tokens": budget}
        optional = _optional(
            **common,
            n=st.integers(min_value=1, max_value=2),
            seed=st.integers(min_value=-(2**63), max_value=2**63 - 1),
            stop=st.lists(short_text, max_size=3),
            logit_bias=st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
            presence_penalty=st.floats(min_value=-2, max_value=2),
            logprobs=st.booleans(),
            tools=st.lists(
                tiny_schema.map(lambda schema: {"type": "function", "function": {"name": "f", "parameters": schema}}),
                max_size=2,
            ),
            response_format=chat_response_format,
        )
    elif protocol == "completions":
        prompt = short_text | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
        required = {"model": st.just(MODEL), "prompt": prompt, "max_tokens": budget}
        optional = _optional(
            **common,
            n=st.integers(min_value=1, max_value=2),
            echo=st.booleans(),
            logprobs=st.integers(min_value=0, max_value=5),
            seed=st.integers(min_value=-(2**63), max_value=2**63 - 1),
            stop=short_text,
        )
    elif protocol == "responses":
        required = {"model": st.just(MODEL), "input": short_text | conversations(protocol), "max_output_tokens": budget}
        optional = _optional(
            **common,
            instructions=short_text,
            tools=st.lists(
                tiny_schema.map(lambda schema: {"type": "function", "name": "f", "parameters": schema}), max_size=2
            ),
            text=responses_text_format,
        )
    else:
        required = {"model": st.just(MODEL), "messages": short_text.map(_chat_messages) | conversations(protocol)}
        if protocol == "messages":
            required["max_tokens"] = budget
        optional = _optional(
            **common,
            system=short_text,
            stop_sequences=st.lists(short_text, max_size=3),
            tools=st.lists(tiny_schema.map(lambda schema: {"name": "f", "input_schema": schema}), max_size=2),
            metadata=st.fixed_dictionaries({"user_id": short_text}),
        )
    return st.builds(lambda fixed, extra: {**fixed, **extra}, st.fixed_dictionaries(required), optional)


@st.composite
def mutated_body(draw, protocol: str) -> dict:
    """A valid body with one field (one it has, a known one, or any name) set to a hostile value, or
    deleted, or with a hostile value inside one of its lists or objects."""
    body = draw(valid_body(protocol))
    known = [*body, *TOKEN_BUDGET_FIELDS.values(), "n", "seed", "top_k", "logit_bias", "stop", "tools", "tool_choice"]
    name = draw(st.sampled_from(known) | st.text(max_size=10))
    how = draw(st.sampled_from(["replace", "delete", "inside"]))
    if how == "delete":
        body.pop(name, None)
    elif how == "inside" and isinstance(body.get(name), list | dict) and body[name]:
        container = body[name]
        key = draw(st.sampled_from(list(range(len(container))) if isinstance(container, list) else list(container)))
        container[key] = draw(hostile_values)
    else:
        body[name] = draw(costly_field_values if name in COSTLY_FIELDS else hostile_values)
    # A body that lost its token budget would generate up to the context window: give it a small one
    # back. Messages requires one, so there the loss is what is tested.
    budget_field = TOKEN_BUDGET_FIELDS.get(protocol)
    if budget_field and budget_field not in body and protocol != "messages":
        body[budget_field] = 2
    return body
