"""Hostile-input fuzzing of the inference API: hypothesis draws requests for the six endpoints (valid
ones, valid ones with one field made hostile, arbitrary JSON, broken framings; good and bad headers)
and sends them to a running stack, which must answer each without a 5xx, with the protocol's error
shape on every 4xx, and still serve a normal request at the end.

    python -m bench.fuzz_api --examples 2000 --base-url http://127.0.0.1:8000 --api-key sk-...

Prints one JSON object: requests sent, statuses, the problems found (grouped, with an example each),
the workers /healthz listed before and after, and whether a normal request succeeded afterwards.
tests/e2e/test_fuzz_api.py runs the same strategies with a fixed budget in `make test`.

Valid generations stay cheap: every body that could be served asks for at most a few tokens. One case
in eight is raw bytes on a socket of its own (framings that no HTTP client library would send).
"""

import argparse
import json
import socket
import sys
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, given, settings
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
REQUEST_TIMEOUT_S = 120.0

# --- values ------------------------------------------------------------------------------------

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

# --- valid bodies ------------------------------------------------------------------------------


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


# --- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzCase:
    protocol: str  # the endpoint's, or "unknown" for a path no endpoint serves
    method: str
    path: str
    headers: dict[str, str]
    content: bytes
    chunked: bool  # sent with Transfer-Encoding: chunked instead of Content-Length
    body_is_object: bool  # the content is a JSON object (what a field-naming 400 can be about)

    def anthropic_shaped(self) -> bool:
        if self.protocol == "unknown":
            return self.path.startswith("/v1/messages") or "anthropic-version" in self.headers
        return self.protocol.startswith("messages")

    def describe(self) -> dict:
        return {
            "method": self.method,
            "path": self.path,
            "headers": {
                name: value for name, value in self.headers.items() if name not in ("authorization", "x-api-key")
            },
            "content": self.content[:300].decode("utf-8", "backslashreplace"),
            "chunked": self.chunked,
        }


def _encoded(body: object) -> bytes:
    # ensure_ascii writes lone surrogates as \ud800 escapes, which is how a client would send them.
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def framed(draw, body: object) -> bytes:
    """The body's JSON, sometimes broken on the way: cut short, a byte that is not UTF-8 put in,
    a BOM in front, or NaN where a number was."""
    content = _encoded(body)
    how = draw(st.sampled_from(["plain"] * 6 + ["cut", "invalid_utf8", "bom", "nan", "in_string"]))
    if how == "cut" and len(content) > 1:
        return content[: draw(st.integers(0, len(content) - 1))]
    if how == "invalid_utf8":
        at = draw(st.integers(0, len(content)))
        return (
            content[:at]
            + draw(st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80", b"\xf8\x88"]))
            + content[at:]
        )
    if how == "in_string" and b'": "' in content:
        return content.replace(b'": "', b'": "\xfe\xfe', 1)
    if how == "bom":
        return b"\xef\xbb\xbf" + content
    if how == "nan":
        return content.replace(b"1", b"NaN", 1)
    return content


def _headers(draw, api_key: str, protocol: str) -> dict[str, str]:
    auth = draw(st.sampled_from(["bearer"] * 5 + ["x-api-key"] * 2 + ["none", "wrong", "garbage"]))
    headers = {}
    if auth == "bearer":
        headers["authorization"] = f"Bearer {api_key}"
    elif auth == "x-api-key":
        headers["x-api-key"] = api_key
    elif auth == "wrong":
        headers["authorization"] = f"Bearer {api_key[:-3]}xyz"
    elif auth == "garbage":
        headers[draw(st.sampled_from(["authorization", "x-api-key"]))] = draw(
            # Header values are bytes: any that HTTP allows (visible ASCII, space, tab and 0x80-0xFF).
            st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=40)
        )
    content_type = draw(
        st.sampled_from(["application/json"] * 4 + [None, "text/plain", "application/json; charset=utf-16"])
    )
    if content_type:
        headers["content-type"] = content_type
    if protocol.startswith("messages") and draw(st.booleans()):
        headers["anthropic-version"] = "2023-06-01"
    return headers


@st.composite
def fuzz_cases(draw, api_key: str) -> FuzzCase:
    protocol = draw(st.sampled_from(list(ENDPOINTS)))
    method, path = ENDPOINTS[protocol]
    route = draw(st.sampled_from(["endpoint"] * 12 + ["wrong_method", "unknown_path"]))
    if route == "wrong_method":
        method = draw(st.sampled_from([m for m in ("GET", "POST", "PUT", "DELETE", "PATCH") if m != method]))
    elif route == "unknown_path":
        protocol = "unknown"
        path = draw(st.sampled_from(["/v1/", "/v1/chat", "/v1/messages/batches", "/v1/completions/", "/v1/x"]))
        path += draw(st.text(st.characters(min_codepoint=0x30, max_codepoint=0x7A), max_size=6))
    generating = protocol in TOKEN_BUDGET_FIELDS or protocol == "messages.count_tokens"
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "any_json"])) if generating else "any_json"
    if kind == "valid":
        body = draw(valid_body(protocol))
    elif kind == "mutated":
        body = draw(mutated_body(protocol))
    else:
        body = draw(json_values | st.dictionaries(st.text(max_size=8), json_values, max_size=5))
    content = draw(framed(body)) if method != "GET" or draw(st.booleans()) else b""
    try:
        parsed = json.loads(
            content.decode("utf-8", "surrogateescape").removeprefix("\ufeff"), parse_constant=_no_constant
        )
    except ValueError:
        parsed = None
    return FuzzCase(
        protocol=protocol,
        method=method,
        path=path,
        headers=_headers(draw, api_key, protocol),
        content=content,
        chunked=bool(content) and draw(st.integers(0, 9)) == 0,
        body_is_object=isinstance(parsed, dict),
    )


def _no_constant(name: str) -> None:
    raise ValueError(name)


@dataclass(frozen=True)
class RawCase:
    """Bytes sent as they are, on a connection of their own: HTTP framings no client library would
    produce (bare LFs, two Content-Lengths, broken chunks, bad request lines, odd header names)."""

    data: bytes

    def describe(self) -> dict:
        return {"raw": self.data[:300].decode("latin-1")}


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"


@st.composite
def raw_cases(draw, api_key: str) -> RawCase:
    protocol = draw(st.sampled_from([name for name in ENDPOINTS if name != "models"]))
    body = _encoded(draw(valid_body(protocol) | mutated_body(protocol)))
    method = draw(st.sampled_from([b"POST"] * 4 + [b"GET", b"PO ST", b"G\x00T", b""]))
    path = draw(st.sampled_from([ENDPOINTS[protocol][1].encode()] * 4 + [b"/v1/%ff%00", b"/v1/" + b"a" * 3000]))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x", b""]))
    headers = [(b"Host", b"x"), (b"Authorization", b"Bearer " + api_key.encode()), (b"Connection", b"close")]
    headers.append((b"Content-Type", b"application/json"))
    # Every framing here is complete or refused at once: none leaves the server waiting for more.
    framing = draw(st.sampled_from(["length"] * 3 + ["short_length", "chunked", "bad_chunks", "both", "two", "bad"]))
    if framing in ("length", "two", "both"):
        headers.append((b"Content-Length", b"%d" % len(body)))
    if framing == "short_length":
        headers.append((b"Content-Length", b"%d" % draw(st.integers(0, max(0, len(body) - 1)))))
    if framing == "two":
        headers.append((b"Content-Length", b"%d" % (len(body) + 1)))
    if framing == "bad":
        headers.append((b"Content-Length", draw(st.sampled_from([b"-1", b"abc", b"1e3", b"0x10", b" "]))))
    if framing in ("chunked", "bad_chunks", "both"):
        headers.append((b"Transfer-Encoding", b"chunked"))
        body = _chunked(body) if framing != "bad_chunks" else b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    odd_header = draw(
        st.sampled_from([None] * 4 + [(b"X Bad", b"1"), (b"X-Null", b"a\x00b"), (b" X-Fold", b"x"), (b"X-\xff", b"1")])
    )
    if odd_header:
        headers.insert(draw(st.integers(0, len(headers))), odd_header)
    eol = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n"]))
    head = method + b" " + path + b" " + version + eol + b"".join(name + b": " + value + eol for name, value in headers)
    return RawCase(head + eol + body)


# --- checks ------------------------------------------------------------------------------------


def send(client: httpx.Client, case: FuzzCase) -> httpx.Response:
    content = iter([case.content[:7], case.content[7:]]) if case.chunked else case.content
    headers = [(name.encode(), value.encode("latin-1")) for name, value in case.headers.items()]
    return client.request(case.method, case.path, headers=headers, content=content)


def problems(case: FuzzCase, response: httpx.Response) -> list[str]:
    """What is wrong with the response to `case`: each problem a short kind, the same for alike ones."""
    status = response.status_code
    if status >= 500:
        return [f"status {status}"]
    if status >= 400:
        return _error_shape_problems(case, response)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _stream_problems(response.text)
    try:
        response.json()
    except ValueError:
        return [f"status {status} with a body that is not JSON"]
    return []


def _error_shape_problems(case: FuzzCase, response: httpx.Response) -> list[str]:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        return [f"status {status} with a body that is not JSON"]
    found = []
    if case.anthropic_shaped():
        if not (isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error"):
            return [f"status {status} not in Anthropic's error shape"]
        if set(body["error"]) != {"type", "message"} or not body["error"]["message"]:
            found.append(f"status {status}: Anthropic error without type and message")
    else:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or set(body) != {"error"} or set(error) != {"message", "type", "param", "code"}:
            return [f"status {status} not in OpenAI's error shape"]
        # A refusal of a JSON object's content names the field it is about (JSON that does not parse,
        # or is not an object, has no field to name).
        if status == 400 and case.body_is_object and error["param"] is None:
            found.append(f"400 without param: {error['message'][:60]}")
    if status == 405 and "allow" not in response.headers:
        found.append("405 without Allow")
    return found


def _stream_problems(text: str) -> list[str]:
    for frame in text.split("\n\n"):
        for line in frame.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[len("data: ") :])
                error = data.get("error") if isinstance(data, dict) else None
                if isinstance(error, dict) and error.get("type") in ("server_error", "api_error"):
                    return [f"stream ended with a server error: {error.get('message', '')[:60]}"]
    return []


def send_raw(base_url: httpx.URL, case: RawCase) -> bytes:
    """Everything the server sends back until it closes the connection (or goes quiet)."""
    reply = b""
    with socket.create_connection((base_url.host, base_url.port), timeout=REQUEST_TIMEOUT_S) as connection:
        connection.sendall(case.data)
        try:
            while chunk := connection.recv(65536):
                reply += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return reply


def raw_problems(reply: bytes) -> tuple[int, list[str]]:
    """(status, problems) of the first response in `reply`. Which protocol's shape a 4xx takes depends
    on how much of the request the server could read, so either is right."""
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        return 0, ["no HTTP response"]
    status = int(status_line[1])
    if status >= 500:
        return status, [f"status {status}"]
    if status < 400:
        return status, []
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunked(body)
    try:
        payload, _ = json.JSONDecoder().raw_decode(body.decode("utf-8"))
    except ValueError:
        return status, [f"raw: status {status} with a body that is not JSON"]
    openai_shaped = isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], dict)
    anthropic_shaped = isinstance(payload, dict) and payload.get("type") == "error" and "error" in payload
    return status, [] if openai_shaped or anthropic_shaped else [f"raw: status {status} in neither error shape"]


def _dechunked(body: bytes) -> bytes:
    data = b""
    while True:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            return data
        data, body = data + rest[:size], rest[size + 2 :]


def exchange(client: httpx.Client, case: "FuzzCase | RawCase") -> tuple[int, list[str], str]:
    """Sends the case: (status, problems found, the start of the reply)."""
    if isinstance(case, RawCase):
        reply = send_raw(client.base_url, case)
        return *raw_problems(reply), reply[:300].decode("latin-1")
    response = send(client, case)
    return response.status_code, problems(case, response), response.text[:300]


@dataclass
class FuzzReport:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: dict[str, dict] = field(default_factory=dict)  # kind -> {"count", "example", "response"}

    def record(self, case: "FuzzCase | RawCase", status: int, found: list[str], reply: str) -> None:
        self.sent += 1
        self.statuses[status] += 1
        for kind in found:
            entry = self.problems.setdefault(kind, {"count": 0, "example": case.describe(), "response": reply})
            entry["count"] += 1


def fuzz(
    client: httpx.Client, api_key: str, *, examples: int, derandomize: bool, report: FuzzReport, fail_fast: bool
) -> None:
    """Sends `examples` drawn cases (one in eight raw framings); with fail_fast the first problem raises
    (and hypothesis shrinks it), else every problem is recorded in `report`."""

    @given(case=st.one_of(*[fuzz_cases(api_key)] * 7, raw_cases(api_key)))
    @settings(
        max_examples=examples,
        derandomize=derandomize,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: FuzzCase | RawCase) -> None:
        status, found, reply = exchange(client, case)
        report.record(case, status, found, reply)
        assert not (fail_fast and found), (found, case.describe(), reply)

    run()


def still_serving(client: httpx.Client, api_key: str) -> bool:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    response = client.post("/v1/chat/completions", json=request, headers={"authorization": f"Bearer {api_key}"})
    return response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def workers(client: httpx.Client) -> list[tuple[str, str]]:
    """(worker id, state) of each worker /healthz lists."""
    return [(worker["worker_id"], worker["state"]) for worker in client.get("/healthz").json()["workers"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--derandomize", action="store_true", help="the same requests every run")
    args = parser.parse_args()
    report = FuzzReport()
    with httpx.Client(base_url=args.base_url, timeout=REQUEST_TIMEOUT_S) as client:
        before = workers(client)
        fuzz(client, args.api_key, examples=args.examples, derandomize=args.derandomize, report=report, fail_fast=False)
        after = workers(client)
        serving = still_serving(client, args.api_key)
    summary = {
        "sent": report.sent,
        "statuses": dict(sorted(report.statuses.items())),
        "problems": report.problems,
        "workers_before": before,
        "workers_after": after,
        "still_serving": serving,
    }
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    sys.exit(0 if serving and not report.problems and before == after else 1)


if __name__ == "__main__":
    main()
