"""What the fuzzer sends: an HTTP request through a client (FuzzCase: an endpoint, or a wrong method
or path; good and bad headers; a body, sometimes broken on the way), or raw bytes on a socket of
their own (RawCase: framings no client library would produce)."""

import json
from dataclasses import dataclass

from hypothesis import strategies as st

from bench.fuzz_api.bodies import ENDPOINTS, TOKEN_BUDGET_FIELDS, json_values, mutated_body, valid_body
from recipe.limits import json_depth

# Python's JSON parser recurses once per level, so the server cannot read a body nested much past
# this at all (its stack is deeper than ours when it parses): it refuses the body as a whole.
READABLE_DEPTH = 500


@dataclass(frozen=True)
class FuzzCase:
    protocol: str  # the endpoint's, or "unknown" for a path no endpoint serves
    method: str
    path: str
    headers: dict[str, str]
    content: bytes
    chunked: bool  # sent with Transfer-Encoding: chunked instead of Content-Length
    # The content is a JSON object the server can read (what a field-naming 400 can be about).
    body_is_object: bool

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
        body_is_object=isinstance(parsed, dict) and json_depth(parsed) <= READABLE_DEPTH,
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
