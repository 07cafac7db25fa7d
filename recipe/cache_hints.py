"""Clients' cache hints, read from a request body and checked before any work is done for it.

OpenAI (Chat Completions, Responses, and the legacy Completions, which takes the same two fields):
- `prompt_cache_key`: a string of at most `RequestLimits.max_prompt_cache_key_chars`. OpenAI routes
  requests that share a key and a prefix to the same machines; our store is global, so routing needs
  no help, and the key is used to scope the cache instead: it is folded into the tenant's cache
  namespace (workers.kvstore.block_hash.scoped_namespace), so requests with the same key share cached
  prefixes and requests with another key or none do not. A client can keep its own users' caches
  apart that way; the tenant's namespace stays the boundary, so no key reaches another tenant's
  blocks. "" is no key.
- `prompt_cache_retention`: "in_memory" is the default behaviour (blocks live as the TTL policy and
  the GC decide); "24h" retains the whole prompt's blocks for 24 hours.
- Chat Completions and Responses: `prompt_cache_breakpoint: {"mode": "explicit", "ttl": "30m" |
  "12h"}` on content parts, whose ttl defaults to `prompt_cache_options.ttl` ("30m"), and
  `prompt_cache_options: {"mode": "implicit" | "explicit", "ttl": ...}`. As OpenAI does, the latest
  four breakpoints are written in explicit mode and the latest three in implicit mode (beside OpenAI's
  own implicit breakpoint, which here is the store's: every block is stored). Each retains the prompt
  up to the end of its part (placed like Anthropic's).

Anthropic Messages (and count_tokens, which checks them and otherwise ignores them):
- `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` (ttl defaults to "5m") on tools,
  system text blocks, message content blocks (text, tool_use, tool_result and the text blocks inside
  one) and at the top level, where it stands for a breakpoint on the last block of the last message.
  At most 4 breakpoints, and in Anthropic's prefix order (tools, system, messages) no "1h" breakpoint
  may follow a "5m" one. Each retains the prompt up to the end of its block for its ttl; where that
  end is in the prompt is recipe.cache_breakpoints' job, told here by an anchor.
Every refusal is a 400 naming the field, such as `messages[2].content[0].cache_control.ttl`.
"""

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from recipe.errors import invalid_request
from recipe.limits import Path, RequestLimits, field_name

OPENAI_RETENTION_S = {"24h": 86400.0}
OPENAI_RETENTIONS = ("in_memory", "24h")
OPENAI_BREAKPOINT_TTL_S = {"30m": 1800.0, "12h": 43200.0}
DEFAULT_OPENAI_TTL = "30m"
# How many of a request's explicit breakpoints OpenAI writes, the latest ones, by prompt_cache_options.mode.
OPENAI_WRITTEN_BREAKPOINTS = {"implicit": 3, "explicit": 4}
# Where each API keeps the content parts that may carry a breakpoint, and the type of a text part.
OPENAI_PARTS = {"chat.completions": ("messages", "text"), "responses": ("input", "input_text")}
ANTHROPIC_TTL_S = {"5m": 300.0, "1h": 3600.0}
DEFAULT_ANTHROPIC_TTL = "5m"
MAX_ANTHROPIC_BREAKPOINTS = 4


@dataclass(frozen=True, slots=True)
class TextEnd:
    """A breakpoint that ends where a string of the body ends in the prompt. With `fill`, the string
    is absent or empty (a tool result with no content) and `path` is where it would be."""

    path: Path
    fill: bool = False


@dataclass(frozen=True, slots=True)
class ToolEnd:
    """A breakpoint at the end of the definition of the tool of this name."""

    name: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """A breakpoint at the end of the conversation's `ordinal`-th tool call (counted from 0, in order)."""

    ordinal: int
    name: str


@dataclass(frozen=True, slots=True)
class PromptEnd:
    """A breakpoint at the end of the whole prompt."""


# None: a block whose end in the prompt is not known (a kind of block our models do not take).
Anchor = TextEnd | ToolEnd | ToolCallEnd | PromptEnd | None


@dataclass(frozen=True, slots=True)
class Breakpoint:
    field: str  # where the hint is in the body, e.g. "messages[2].content[0].cache_control"
    ttl: str  # the API's name of how long it keeps the prefix: "5m", "1h", "24h"
    retain_s: float
    anchor: Anchor


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """What one request asks of the cache."""

    breakpoints: tuple[Breakpoint, ...] = ()
    prompt_cache_key: str | None = None
    # As given: Responses echo them.
    prompt_cache_retention: str | None = None
    prompt_cache_options: Mapping | None = None


def read_cache_request(protocol: str, body: Mapping, limits: RequestLimits) -> CacheRequest:
    """The request's cache hints; raises an ApiError (400, naming the field) for an invalid one."""
    if protocol in ("messages", "messages.count_tokens"):
        return CacheRequest(breakpoints=_anthropic_breakpoints(body))
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise invalid_request(f"`prompt_cache_key` must be a string, got {key!r}", "prompt_cache_key")
    if key is not None and len(key) > limits.max_prompt_cache_key_chars:
        raise invalid_request(
            f"`prompt_cache_key` has {len(key)} characters; at most {limits.max_prompt_cache_key_chars} are allowed",
            "prompt_cache_key",
        )
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in OPENAI_RETENTIONS:
        raise invalid_request(
            f'`prompt_cache_retention` must be "in_memory" or "24h", got {retention!r}', "prompt_cache_retention"
        )
    mode, default_ttl = _prompt_cache_options(body)
    breakpoints = []
    if protocol in OPENAI_PARTS:
        explicit = _openai_breakpoints(body, *OPENAI_PARTS[protocol], default_ttl)
        breakpoints += explicit[-OPENAI_WRITTEN_BREAKPOINTS[mode] :]
    if retention in OPENAI_RETENTION_S:
        breakpoints.append(Breakpoint("prompt_cache_retention", retention, OPENAI_RETENTION_S[retention], PromptEnd()))
    return CacheRequest(
        breakpoints=tuple(breakpoints),
        prompt_cache_key=key or None,
        prompt_cache_retention=retention,
        prompt_cache_options=body.get("prompt_cache_options"),
    )


def _prompt_cache_options(body: Mapping) -> tuple[str, str]:
    """(mode, the default ttl of explicit breakpoints)."""
    value = body.get("prompt_cache_options")
    if value is None:
        return "implicit", DEFAULT_OPENAI_TTL
    fields = _checked_object(
        value,
        ("prompt_cache_options",),
        {"mode": tuple(OPENAI_WRITTEN_BREAKPOINTS), "ttl": tuple(OPENAI_BREAKPOINT_TTL_S)},
    )
    return fields.get("mode") or "implicit", fields.get("ttl") or DEFAULT_OPENAI_TTL


def _openai_breakpoints(body: Mapping, items_field: str, text_type: str, default_ttl: str) -> list[Breakpoint]:
    found = []
    for index, item in _items(body.get(items_field)):
        for position, part in _items(item.get("content")):
            value = part.get("prompt_cache_breakpoint")
            if value is None:
                continue
            path = (items_field, index, "content", position)
            where = (*path, "prompt_cache_breakpoint")
            fields = _checked_object(value, where, {"mode": ("explicit",), "ttl": tuple(OPENAI_BREAKPOINT_TTL_S)})
            if fields.get("mode") is None:
                mode = field_name((*where, "mode"))
                raise invalid_request(f'`{mode}` is required: "explicit"', mode)
            ttl = fields.get("ttl") or default_ttl
            is_text = part.get("type") == text_type and isinstance(part.get("text"), str)
            anchor = TextEnd((*path, "text")) if is_text else None
            found.append(Breakpoint(field_name(where), ttl, OPENAI_BREAKPOINT_TTL_S[ttl], anchor))
    return found


def _checked_object(value: object, path: Path, allowed: Mapping[str, tuple[str, ...]]) -> Mapping:
    """An object whose fields are among `allowed`, each absent, null or one of its values."""
    name = field_name(path)
    if not isinstance(value, Mapping):
        raise invalid_request(f"`{name}` must be an object", name)
    for key, field_value in value.items():
        if key not in allowed:
            unknown = field_name((*path, key))
            raise invalid_request(f"`{unknown}`: unknown field; `{name}` takes {_listed(allowed)}", unknown)
        if field_value is not None and field_value not in allowed[key]:
            where = field_name((*path, key))
            raise invalid_request(f"`{where}` must be {_listed(allowed[key], quote=True)}, got {field_value!r}", where)
    return value


def _listed(names: object, *, quote: bool = False) -> str:
    spelled = [f'"{name}"' if quote else f"`{name}`" for name in names]
    return " or ".join(spelled) if quote else " and ".join(spelled)


def _anthropic_breakpoints(body: Mapping) -> tuple[Breakpoint, ...]:
    found = []
    for index, tool in _items(body.get("tools")):
        name = tool.get("name")
        found += _own_breakpoint(tool, ("tools", index), ToolEnd(name) if isinstance(name, str) else None)
    for index, block in _items(body.get("system")):
        found += _own_breakpoint(block, ("system", index), _text_anchor(block, ("system", index)))
    tool_calls = itertools.count()
    last_block: tuple[bool, Anchor] | None = None  # (whether it has a cache_control of its own, its anchor)
    for index, message in _items(body.get("messages")):
        content = message.get("content")
        if isinstance(content, str):
            last_block = (False, TextEnd(("messages", index, "content")))
        for position, block in _items(content):
            path = ("messages", index, "content", position)
            anchor = _block_anchor(block, path, tool_calls)
            found += _nested_breakpoints(block, path)
            found += _own_breakpoint(block, path, anchor)
            last_block = (block.get("cache_control") is not None, anchor)
    top_level = body.get("cache_control")
    if top_level is not None:
        ttl = _checked_ttl(top_level, ("cache_control",))
        # It marks the last block, unless that block has a breakpoint of its own.
        if last_block is not None and not last_block[0]:
            found.append(Breakpoint("cache_control", ttl, ANTHROPIC_TTL_S[ttl], last_block[1]))
    _check_anthropic_rules(found)
    return tuple(found)


def _items(value: object) -> Iterator[tuple[int, Mapping]]:
    """The objects of a list, with their index (what is not an object is the library's to refuse)."""
    if isinstance(value, list):
        yield from ((index, item) for index, item in enumerate(value) if isinstance(item, Mapping))


def _block_anchor(block: Mapping, path: Path, tool_calls: Iterator[int]) -> Anchor:
    kind = block.get("type")
    if kind == "tool_use":  # every tool_use counts toward the ordinals, with a breakpoint or not
        name = block.get("name")
        ordinal = next(tool_calls)
        return ToolCallEnd(ordinal, name) if isinstance(name, str) else None
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, str) and content:
            return TextEnd((*path, "content"))
        if not content:
            return TextEnd((*path, "content"), fill=True)
        if isinstance(content, list) and isinstance(content[-1], Mapping):
            return _text_anchor(content[-1], (*path, "content", len(content) - 1))
        return None
    return _text_anchor(block, path)


def _text_anchor(block: Mapping, path: Path) -> Anchor:
    return TextEnd((*path, "text")) if block.get("type") == "text" and isinstance(block.get("text"), str) else None


def _nested_breakpoints(block: Mapping, path: Path) -> list[Breakpoint]:
    """Breakpoints on the blocks inside a tool result."""
    if block.get("type") != "tool_result":
        return []
    found = []
    for position, inner in _items(block.get("content")):
        inner_path = (*path, "content", position)
        found += _own_breakpoint(inner, inner_path, _text_anchor(inner, inner_path))
    return found


def _own_breakpoint(block: Mapping, path: Path, anchor: Anchor) -> list[Breakpoint]:
    value = block.get("cache_control")
    if value is None:
        return []
    ttl = _checked_ttl(value, (*path, "cache_control"))
    return [Breakpoint(field_name((*path, "cache_control")), ttl, ANTHROPIC_TTL_S[ttl], anchor)]


def _checked_ttl(value: object, path: Path) -> str:
    fields = _checked_object(value, path, {"type": ("ephemeral",), "ttl": tuple(ANTHROPIC_TTL_S)})
    if fields.get("type") is None:
        kind = field_name((*path, "type"))
        raise invalid_request(f'`{kind}` is required: "ephemeral"', kind)
    return fields.get("ttl") or DEFAULT_ANTHROPIC_TTL


def _check_anthropic_rules(breakpoints: list[Breakpoint]) -> None:
    if len(breakpoints) > MAX_ANTHROPIC_BREAKPOINTS:
        extra = breakpoints[MAX_ANTHROPIC_BREAKPOINTS].field
        raise invalid_request(
            f"`{extra}`: a request may have at most {MAX_ANTHROPIC_BREAKPOINTS} blocks with cache_control; "
            f"found {len(breakpoints)}",
            extra,
        )
    seen_short = False
    for breakpoint in breakpoints:
        if breakpoint.ttl == "1h" and seen_short:
            raise invalid_request(
                f'`{breakpoint.field}`: a cache_control with ttl "1h" may not come after one with ttl "5m" '
                "(in the order tools, system, messages)",
                breakpoint.field,
            )
        seen_short = seen_short or breakpoint.ttl == "5m"
