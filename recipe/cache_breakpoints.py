"""Where each cache breakpoint of a request ends in its prompt, in tokens: the prefix its CacheHint
covers (recipe.cache_hints reads the breakpoints, workers.kvstore.hints keeps the blocks).

The prompt is what deepseek-recipe converts the request into, rendered by the model's encoding; the
request's blocks are not in it one for one (system blocks are joined, a user message's text blocks
become messages of their own, tool results become tool messages, tools go into the system turn).
So positions are found in the rendered prompt itself:

- Text (a text block, a tool result): the request is converted and rendered once more with a marker
  appended to each such string, a private-use character the prompt does not contain, one per
  breakpoint. The conversion and the rendering copy a request's text into the prompt without
  looking into it, so the marked prompt is the real one with the markers inserted: where a marker
  lands, less the markers before it, is where its string ends in the real prompt. That is checked
  for every breakpoint (the marked prompt up to its marker, markers removed, must be the real
  prompt's beginning); one that fails the check keeps nothing rather than the wrong prefix.
- Tools and tool calls: the ChatML rendering records where each tool definition and each assistant
  tool call ends (recipe.chatml.PromptText); a tool is found by its name, a tool_use block by its
  position among the conversation's tool calls, checked by name. The DeepSeek encoding does not say,
  so there such a breakpoint keeps nothing of its own (a later breakpoint still covers it).
- The whole prompt (OpenAI's "24h" retention): its length.

A position becomes a token count through the prompt's token ids (recipe.prompt_encoding.tokens_before):
the tokens wholly before it. A breakpoint that covers no token keeps nothing.
"""

import itertools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import deepseek_recipe

from recipe.cache_hints import Breakpoint, PromptEnd, TextEnd, ToolCallEnd, ToolEnd
from recipe.chatml import PromptText
from recipe.errors import ApiError
from recipe.limits import Path
from recipe.prompt_encoding import tokens_before
from workers.protocol.messages import MAX_CACHE_HINTS, CacheHint
from workers.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Unicode's private use area: characters no tokenizer gives a meaning and prompts rarely hold.
FIRST_MARKER, LAST_MARKER = 0xE000, 0xF8FF
PRIVATE_USE = re.compile(f"[{chr(FIRST_MARKER)}-{chr(LAST_MARKER)}]")


@dataclass(frozen=True, slots=True)
class PlacedHints:
    """The hints for the engine, and the API's name of each one's lifetime (for usage reports)."""

    hints: tuple[CacheHint, ...] = ()
    ttls: tuple[str, ...] = ()


def place_breakpoints(
    breakpoints: Sequence[Breakpoint],
    *,
    body: Mapping,
    prompt: PromptText,
    conversation: deepseek_recipe.Conversation,
    token_ids: Sequence[int],
    tokenizer: Tokenizer,
    render: Callable[[Mapping], PromptText],
) -> PlacedHints:
    """`prompt` and `conversation` are the request's, `token_ids` its prompt's; `render` converts
    and renders a body as the request's was (the marked one)."""
    positions = dict(_text_positions(breakpoints, body, prompt, render))
    calls = [call.name for message in conversation.messages for call in message.tool_calls or []]
    tools = [tool.name for tool in conversation.tools or []]
    for index, breakpoint in enumerate(breakpoints):
        anchor = breakpoint.anchor
        if isinstance(anchor, ToolEnd) and len(prompt.tool_ends) == len(tools) and anchor.name in tools:
            positions[index] = prompt.tool_ends[tools.index(anchor.name)]
        elif isinstance(anchor, ToolCallEnd) and len(prompt.tool_call_ends) == len(calls) > anchor.ordinal:
            if calls[anchor.ordinal] == anchor.name:
                positions[index] = prompt.tool_call_ends[anchor.ordinal]
        elif isinstance(anchor, PromptEnd):
            positions[index] = len(prompt.text)
    placed = sorted(positions.items())
    counts = tokens_before(token_ids, tokenizer, prompt.text, [position for _, position in placed])
    if counts is None:
        log.warning("the prompt's tokens do not spell its text; its cache breakpoints keep nothing")
        return PlacedHints()
    hints, ttls = [], []
    for (index, _), count in zip(placed, counts):
        if count > 0 and len(hints) < MAX_CACHE_HINTS:
            hints.append(CacheHint(prefix_tokens=count, retain_s=breakpoints[index].retain_s))
            ttls.append(breakpoints[index].ttl)
    return PlacedHints(tuple(hints), tuple(ttls))


def _text_positions(
    breakpoints: Sequence[Breakpoint], body: Mapping, prompt: PromptText, render: Callable[[Mapping], PromptText]
) -> list[tuple[int, int]]:
    """(breakpoint index, position in the prompt) of each breakpoint on text that could be placed."""
    texts = [(index, bp.anchor) for index, bp in enumerate(breakpoints) if isinstance(bp.anchor, TextEnd)]
    if not texts:
        return []
    markers = _unused_characters(prompt.text, len(texts))
    if len(markers) < len(texts):
        log.info("the prompt holds nearly every private-use character; its cache breakpoints on text keep nothing")
        return []
    marked_body = body
    for (_, anchor), marker in zip(texts, markers):
        marked_body = _with_marker(marked_body, anchor.path, marker, fill=anchor.fill)
    try:
        marked = render(marked_body).text
    except ApiError as error:
        log.info("a request marked for its cache breakpoints did not convert (%s); they keep nothing", error)
        return []
    positions = []
    for (index, _), marker in zip(texts, markers):
        at = marked.find(marker)
        if at < 0 or marked.find(marker, at + 1) >= 0:
            continue
        before = marked[:at]
        for other in markers:
            before = before.replace(other, "")
        if prompt.text.startswith(before):
            positions.append((index, len(before)))
    return positions


def _unused_characters(text: str, count: int) -> list[str]:
    """Up to `count` private-use characters that `text` does not hold."""
    used = set(PRIVATE_USE.findall(text))
    unused = (chr(code) for code in range(FIRST_MARKER, LAST_MARKER + 1) if chr(code) not in used)
    return list(itertools.islice(unused, count))


def _with_marker(body: Mapping, path: Path, marker: str, *, fill: bool) -> dict:
    """A copy of `body` (shared where `path` does not go) with `marker` after the string at `path`,
    or, with `fill`, in its place."""
    root = dict(body)
    container: dict | list = root
    for key in path[:-1]:
        child = container[key]
        child = dict(child) if isinstance(child, Mapping) else list(child)
        container[key] = child
        container = child
    last = path[-1]
    container[last] = marker if fill else container[last] + marker
    return root
