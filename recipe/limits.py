"""Bounds on what one API request may carry, checked before any work is done for it.

`check_request_bounds` runs first for every request of every protocol. One pass over the whole body
refuses what no field may hold: nesting past `max_json_depth`, integers past 64 bits, numbers that are
not finite, and strings that are not Unicode text (lone surrogates, which is also what the gateway
turns invalid UTF-8 bytes into). Then the protocol's layout says where its messages, tools, schemas,
stop sequences and logit biases are, and each is held to its limit. Every refusal names the field as
a path such as `messages[3].content[0].text`.

The gateway builds RequestLimits from its settings (`SLUICE_MAX_<FIELD>`, controlplane/settings.py);
the defaults here are those settings' defaults.
"""

import ipaddress
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

from recipe.errors import invalid_request

# deepseek-recipe converts a body into serde_json values, which nest at most 128 deep and hold
# integers in [-2**63, 2**64): past either it raises, where it should refuse.
LIBRARY_MAX_JSON_DEPTH = 127
LIBRARY_INTEGER_RANGE = (-(2**63), 2**64 - 1)
# deepseek-recipe refuses more stop sequences than this, without naming the field.
LIBRARY_MAX_STOP_SEQUENCES = 16
# A value nested too deep is named by its path this far down; past that the path only repeats itself.
DEPTH_PATH_SHOWN = 4


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_json_depth: int = 64  # nesting of arrays and objects anywhere in a body
    max_schema_depth: int = 32  # nesting of one JSON schema (a tool's parameters, a response format)
    max_schema_bytes: int = 64 * 1024  # one JSON schema (serialized) or output regex: grammars compile from them
    max_messages: int = 2048  # messages (Chat, Messages) or input items (Responses)
    max_content_parts: int = 512  # content parts of one message (or of Anthropic's system prompt)
    max_tools: int = 128
    max_stop_sequences: int = LIBRARY_MAX_STOP_SEQUENCES
    max_stop_sequence_chars: int = 256  # the engine holds back this much text to match a stop sequence
    max_logit_bias: int = 1024  # entries of logit_bias, each applied at every step
    max_choices: int = 16  # n: each choice is an engine request
    max_prompt_cache_key_chars: int = 64  # OpenAI's prompt_cache_key (recipe.cache_hints)
    # Image inputs (recipe.images): how many, and each one's encoded bytes (sent or fetched) and
    # decoded pixels; and the seconds one image URL may take to fetch, redirects included.
    max_images: int = 16
    max_image_bytes: int = 8 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    image_fetch_timeout_s: int = 10
    # Networks (CIDR) an image URL may resolve to although they are private: an operator's own image
    # service. Metadata addresses stay refused whatever this says (recipe.images.destinations).
    image_fetch_allowed_networks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for network in self.image_fetch_allowed_networks:
            try:
                ipaddress.ip_network(network)
            except ValueError:
                raise ValueError(f"image_fetch_allowed_networks: {network!r} is not a network (CIDR)") from None
        for field in fields(self):
            if field.name != "image_fetch_allowed_networks" and getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be at least 1, got {getattr(self, field.name)}")
        if self.max_json_depth > LIBRARY_MAX_JSON_DEPTH:
            raise ValueError(f"max_json_depth is at most {LIBRARY_MAX_JSON_DEPTH}, got {self.max_json_depth}")
        if self.max_stop_sequences > LIBRARY_MAX_STOP_SEQUENCES:
            raise ValueError(
                f"max_stop_sequences is at most {LIBRARY_MAX_STOP_SEQUENCES}, got {self.max_stop_sequences}"
            )


# A field's place in the body: keys and list indexes from the top; "*" in a layout means every item.
Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where one protocol keeps the fields that have limits."""

    messages: Path | None = None
    contents: tuple[Path, ...] = ()
    tools: Path | None = None
    schemas: tuple[Path, ...] = ()  # JSON schemas, and output regexes (grammars compile from both)
    stop: Path | None = None
    logit_bias: Path | None = None


_LAYOUTS = {
    "chat.completions": _Layout(
        messages=("messages",),
        contents=(("messages", "*", "content"),),
        tools=("tools",),
        schemas=(
            ("tools", "*", "function", "parameters"),
            ("response_format", "json_schema", "schema"),
            ("response_format", "regex"),
        ),
        stop=("stop",),
        logit_bias=("logit_bias",),
    ),
    "completions": _Layout(stop=("stop",), logit_bias=("logit_bias",)),
    "responses": _Layout(
        messages=("input",),
        contents=(("input", "*", "content"),),
        tools=("tools",),
        schemas=(("tools", "*", "parameters"), ("text", "format", "schema")),
    ),
    "messages": _Layout(
        messages=("messages",),
        contents=(("messages", "*", "content"), ("system",)),
        tools=("tools",),
        schemas=(("tools", "*", "input_schema"),),
        stop=("stop_sequences",),
    ),
}


def check_request_bounds(protocol: str, body: Mapping, limits: RequestLimits) -> None:
    """Raises an ApiError (400, naming the field) for the first bound the body breaks."""
    _check_values(body, limits.max_json_depth)
    layout = _LAYOUTS["messages" if protocol == "messages.count_tokens" else protocol]
    _check_length(body, layout.messages, limits.max_messages, "items")
    for path in layout.contents:
        _check_length(body, path, limits.max_content_parts, "content parts")
    _check_length(body, layout.tools, limits.max_tools, "tools")
    _check_length(body, layout.logit_bias, limits.max_logit_bias, "entries")
    _check_stop_sequences(body, layout.stop, limits)
    for path in layout.schemas:
        for where, schema in _values_at(body, path):
            _check_schema(where, schema, limits)


def field_name(path: Path) -> str:
    """`messages[3].content[0].text`; keys that are not identifiers are quoted (and \\u-escaped)."""
    name = ""
    for key in path:
        if isinstance(key, int):
            name += f"[{key}]"
        elif key.isidentifier():
            name += f".{key}" if name else key
        else:
            name += f"[{json.dumps(key)}]"
    return name


def _check_values(body: Mapping, max_depth: int) -> None:
    """Checks every value in the body, without recursion (the body may nest deeper than Python's stack)."""
    # (value, depth, path): paths are built once per container, not per scalar.
    pending: list[tuple[object, int, Path]] = [(body, 1, ())]
    while pending:
        container, depth, path = pending.pop()
        if depth > max_depth:
            name = field_name(path[:DEPTH_PATH_SHOWN])
            raise invalid_request(
                f"`{name}` is nested too deep: a request body may nest arrays and objects {max_depth} deep", name
            )
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            if isinstance(key, str):
                _check_text(key, (*path, key), "a key")
            if isinstance(value, dict | list):
                pending.append((value, depth + 1, (*path, key)))
            elif isinstance(value, str):
                _check_text(value, (*path, key), "text")
            elif isinstance(value, int) and not isinstance(value, bool):
                if not LIBRARY_INTEGER_RANGE[0] <= value <= LIBRARY_INTEGER_RANGE[1]:
                    name = field_name((*path, key))
                    raise invalid_request(f"`{name}` is an integer outside the 64-bit range", name)
            elif isinstance(value, float) and not math.isfinite(value):
                name = field_name((*path, key))
                raise invalid_request(f"`{name}` is not a finite number", name)


def _check_text(text: str, path: Path, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        name = field_name(path)
        raise invalid_request(
            f"`{name}` is {what} that is not valid UTF-8 (a lone surrogate or an invalid byte at character "
            f"{error.start})",
            name,
        ) from None


def _values_at(body: Mapping, path: Path, where: Path = ()) -> Iterator[tuple[Path, object]]:
    """(path, value) of every value at `path`, "*" standing for each item of a list."""
    if not path:
        yield where, body
        return
    key, rest = path[0], path[1:]
    if key == "*":
        if isinstance(body, list):
            for index, item in enumerate(body):
                yield from _values_at(item, rest, (*where, index))
    elif isinstance(body, Mapping) and key in body:
        yield from _values_at(body[key], rest, (*where, key))


def _check_length(body: Mapping, path: Path | None, limit: int, unit: str) -> None:
    if path is None:
        return
    for where, value in _values_at(body, path):
        if isinstance(value, list | Mapping):
            _refuse_longer(where, value, limit, unit)


def _refuse_longer(where: Path, value: list | Mapping, limit: int, unit: str) -> None:
    if len(value) > limit:
        name = field_name(where)
        raise invalid_request(f"`{name}` has {len(value)} {unit}; at most {limit} are allowed", name)


def _check_stop_sequences(body: Mapping, path: Path | None, limits: RequestLimits) -> None:
    if path is None:
        return
    for where, stop in _values_at(body, path):
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            continue  # not a stop sequence at all: the protocol's own check says so
        _refuse_longer(where, stops, limits.max_stop_sequences, "stop sequences")
        for item in stops:
            if isinstance(item, str) and len(item) > limits.max_stop_sequence_chars:
                name = field_name(where)
                raise invalid_request(
                    f"`{name}` has a stop sequence longer than {limits.max_stop_sequence_chars} characters", name
                )


def _check_schema(where: Path, schema: object, limits: RequestLimits) -> None:
    name = field_name(where)
    if json_depth(schema) > limits.max_schema_depth:
        raise invalid_request(f"`{name}` nests more than {limits.max_schema_depth} deep", name)
    text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    size = len(text.encode())
    if size > limits.max_schema_bytes:
        raise invalid_request(f"`{name}` is {size} bytes; at most {limits.max_schema_bytes} are allowed", name)


def json_depth(value: object) -> int:
    """Levels of arrays and objects in a parsed JSON value (iteratively: no recursion limit)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
