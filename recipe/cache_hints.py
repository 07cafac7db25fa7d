"""Clients' cache hints, read from a request body and checked before any work is done for it.

OpenAI (Chat Completions, Responses, and the legacy Completions, which takes the same two fields):
- `prompt_cache_key`: a string of at most `RequestLimits.max_prompt_cache_key_chars`. OpenAI routes
  requests that share a key and a prefix to the same machines; our store is global, so routing needs
  no help, and the key is used to scope the cache instead: it is folded into the tenant's cache
  namespace (workers.block_hash.scoped_namespace), so requests with the same key share cached
  prefixes and requests with another key or none do not. A client can keep its own users' caches
  apart that way; the tenant's namespace stays the boundary, so no key reaches another tenant's
  blocks. "" is no key.
- `prompt_cache_retention`: "in_memory" is the default behaviour (blocks live as the TTL policy and
  the GC decide); "24h" retains the whole prompt's blocks for 24 hours.

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
ANTHROPIC_TTL_S = {"5m": 300.0, "1h": 3600.0}
DEFAULT_ANTHROPIC_TTL = "5m"
MAX_ANTHROPIC_BREAKPOINTS = 4
CACHE_CONTROL_FIELDS = frozenset({"type", "ttl"})


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
    prompt_cache_retention: str | None = None  # as given (Responses echoes it)


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
    breakpoints = ()
    if retention in OPENAI_RETENTION_S:
        breakpoints = (Breakpoint("prompt_cache_retention", retention, OPENAI_RETENTION_S[retention], PromptEnd()),)
    return CacheRequest(breakpoints=breakpoints, prompt_cache_key=key or None, prompt_cache_retention=retention)


def _anthropic_breakpoints(body: Mapping) -> tuple[Breakpoint, ...]:
    found = []
    for index, tool in _items(body.get("tools")):
        name = tool.get("name")
        found += _own_breakpoint(tool, ("tools", index), ToolEnd(name) if isinstance(name, str) else None)
    for index, block in _items(body.get("system")):
        found += _own_breakpoint(block, ("system", index), _text_anchor(block, ("system", index)))
    tool_calls = itertools.count()
    last_block: tuple[Mapping | None, Path, Anchor] | None = None
    for index, message in _items(body.get("messages")):
        content = message.get("content")
        if isinstance(content, str):
            last_block = (None, ("messages", index, "content"), TextEnd(("messages", index, "content")))
        for position, block in _items(content):
            path = ("messages", index, "content", position)
            anchor = _block_anchor(block, path, tool_calls)
            found += _nested_breakpoints(block, path)
            found += _own_breakpoint(block, path, anchor)
            last_block = (block, path, anchor)
    top_level = body.get("cache_control")
    if top_level is not None:
        ttl = _checked_ttl(top_level, ("cache_control",))
        # It marks the last block, unless that block has a breakpoint of its own.
        if last_block is not None and (last_block[0] is None or last_block[0].get("cache_control") is None):
            found.append(Breakpoint("cache_control", ttl, ANTHROPIC_TTL_S[ttl], last_block[2]))
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
    name = field_name(path)
    if not isinstance(value, Mapping):
        raise invalid_request(f'`{name}` must be an object such as {{"type": "ephemeral", "ttl": "5m"}}', name)
    for key in value:
        if key not in CACHE_CONTROL_FIELDS:
            unknown = field_name((*path, key))
            raise invalid_request(f"`{unknown}`: unknown field; cache_control takes `type` and `ttl`", unknown)
    if value.get("type") != "ephemeral":
        kind = field_name((*path, "type"))
        raise invalid_request(f'`{kind}` must be "ephemeral", got {value.get("type")!r}', kind)
    ttl = value.get("ttl")
    if ttl is None:
        return DEFAULT_ANTHROPIC_TTL
    if ttl not in ANTHROPIC_TTL_S:
        where = field_name((*path, "ttl"))
        raise invalid_request(f'`{where}` must be "5m" or "1h", got {ttl!r}', where)
    return ttl


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
