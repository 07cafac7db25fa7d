"""Conversations as ChatML prompts (`<|im_start|>role\\n...<|im_end|>\\n`), for SmolLM2 and any model
whose chat template uses them.

A plain conversation renders exactly as the model's own template renders it, including the default
system prompt such templates insert when the first message is not a system message. What those
templates lack is added in one native format: a tools section in the system prompt, assistant tool
calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (one call per block), and
a prompt that already opens `<tool_call>` when the request requires a call, so that the grammar
(workers.engine.structured.grammar) only has to produce the body.

Tool results become user turns that wrap each result in `<tool_response>` tags, not turns of a
`tool` role: SmolLM2's template and training know only system, user and assistant turns, so a user
turn keeps the prompt in the distribution the model learned, and the results of one parallel call
share one turn, keeping the user/assistant alternation.
"""

import itertools
import json
import weakref
from dataclasses import dataclass

import deepseek_recipe

from workers.protocol.messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from workers.text.tokenizer import Tokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_SECTION = """# Tools

You may call one or more functions to help with the user's request. The functions are described by \
these JSON schemas:
<tools>
{tools}
</tools>

To call a function, write its name and arguments as a JSON object in a <tool_call></tool_call> block:
<tool_call>{{"name": "<function-name>", "arguments": {{<arguments as JSON>}}}}</tool_call>
Write one block per call; write several blocks to call several functions. Results come back in \
<tool_response></tool_response> blocks."""
REQUIRED_CALL_NOTE = "\n\nYou must call a function now."
JSON_OBJECT_NOTE = "Reply with a JSON object only."
JSON_SCHEMA_NOTE = "Reply with JSON only, matching this JSON schema:\n{schema}"
SECTION_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class PromptText:
    """A prompt and where its control tokens are: each range is a half-open (start, end) span of
    `text` (str indices) that is one special token; everything else is plain text.

    Where each tool's definition and each assistant tool call ends (str indices, in the
    conversation's order), for cache breakpoints on them (recipe.cache_breakpoints); empty for a
    prompt rendered by another encoding."""

    text: str
    special_ranges: tuple[tuple[int, int], ...]
    tool_ends: tuple[int, ...] = ()
    tool_call_ends: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Content:
    """A turn's content, and where the tool definitions and tool calls in it end (offsets into it)."""

    text: str
    tool_ends: tuple[int, ...] = ()
    tool_call_ends: tuple[int, ...] = ()


class _PromptWriter:
    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._length = 0
        self._special_ranges: list[tuple[int, int]] = []
        self._tool_ends: list[int] = []
        self._tool_call_ends: list[int] = []

    def special(self, token: str) -> None:
        self._special_ranges.append((self._length, self._length + len(token)))
        self.text(token)

    def text(self, text: str) -> None:
        self._pieces.append(text)
        self._length += len(text)

    def open_turn(self, role: str, content: _Content) -> None:
        """The turn's start and content, leaving it open."""
        self.special(IM_START)
        start = self._length + len(role) + 1
        self.text(f"{role}\n{content.text}")
        self._tool_ends += [start + end for end in content.tool_ends]
        self._tool_call_ends += [start + end for end in content.tool_call_ends]

    def turn(self, role: str, content: _Content | str) -> None:
        self.open_turn(role, content if isinstance(content, _Content) else _Content(content))
        self.special(IM_END)
        self.text("\n")

    def prompt(self) -> PromptText:
        return PromptText(
            "".join(self._pieces), tuple(self._special_ranges), tuple(self._tool_ends), tuple(self._tool_call_ends)
        )


def render_chatml(conversation: deepseek_recipe.Conversation, *, default_system_prompt: str | None) -> PromptText:
    """The prompt for `conversation`, ending with the assistant's turn opened (or, for a final
    assistant message marked `prefix`, continuing that message)."""
    messages = conversation.messages
    writer = _PromptWriter()
    has_system_message = bool(messages) and messages[0].role == "system"
    leading_system = messages[0].content if has_system_message else default_system_prompt
    system = _system_content(leading_system, _tools_section(conversation), _response_format_note(conversation))
    if system is not None or has_system_message:
        writer.turn("system", system or "")

    index = 1 if has_system_message else 0
    while index < len(messages):
        message = messages[index]
        if message.role == "tool":
            results = []
            while index < len(messages) and messages[index].role == "tool":
                results.append(f"<tool_response>\n{messages[index].content}\n</tool_response>")
                index += 1
            writer.turn("user", "\n".join(results))
            continue
        if message.role == "assistant" and message.prefix and index == len(messages) - 1:
            writer.open_turn("assistant", _assistant_content(message))
            return writer.prompt()
        role = "system" if message.role == "latest_reminder" else message.role
        content = _assistant_content(message) if message.role == "assistant" else _Content(message.content)
        writer.turn(role, content)
        index += 1

    writer.special(IM_START)
    writer.text("assistant\n")
    if conversation.tool_choice == "required" and conversation.tools:
        writer.text(TOOL_CALL_OPEN)
    return writer.prompt()


_default_system_prompts: "weakref.WeakKeyDictionary[Tokenizer, str | None]" = weakref.WeakKeyDictionary()


def default_system_prompt(tokenizer: Tokenizer) -> str | None:
    """The system prompt the model's chat template inserts when a conversation has none (SmolLM2:
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"), read by rendering a
    conversation of one user message; None when the template inserts none."""
    if tokenizer not in _default_system_prompts:
        _default_system_prompts[tokenizer] = _probe_default_system_prompt(tokenizer)
    return _default_system_prompts[tokenizer]


def _probe_default_system_prompt(tokenizer: Tokenizer) -> str | None:
    if tokenizer.chat_template is None:
        return None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "probe"}], add_generation_prompt=False)
    system_start = f"{IM_START}system\n"
    if not rendered.startswith(system_start):
        return None
    end = rendered.find(IM_END, len(system_start))
    return rendered[len(system_start) : end] if end != -1 else None


def _system_content(leading: str | None, tools: _Content | None, note: str | None) -> _Content | None:
    """The sections present, joined by blank lines."""
    sections = (_Content(leading or ""), tools or _Content(""), _Content(note or ""))
    present = [section for section in sections if section.text]
    if not present:
        return None
    text, tool_ends, offset = [], [], 0
    for section in present:
        text.append(section.text)
        tool_ends += [offset + end for end in section.tool_ends]
        offset += len(section.text) + len(SECTION_SEPARATOR)
    return _Content(SECTION_SEPARATOR.join(text), tool_ends=tuple(tool_ends))


def _tools_section(conversation: deepseek_recipe.Conversation) -> _Content | None:
    if not conversation.tools:
        return None
    lines = [
        json.dumps(
            {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters or {}},
            ensure_ascii=False,
        )
        for tool in conversation.tools
    ]
    section = TOOLS_SECTION.format(tools="\n".join(lines))
    if conversation.tool_choice == "required":
        section += REQUIRED_CALL_NOTE
    # The text before the placeholder has no braces, so formatting leaves its length as it is.
    first = TOOLS_SECTION.index("{tools}")
    ends = itertools.accumulate((len(line) + (index > 0) for index, line in enumerate(lines)), initial=first)
    return _Content(section, tool_ends=tuple(ends)[1:])


def _response_format_note(conversation: deepseek_recipe.Conversation) -> str | None:
    """The grammar enforces the format; telling the model too lets it fill the format with sense."""
    if conversation.response_format == "json_object":
        return JSON_OBJECT_NOTE
    if conversation.response_format == "json_schema":
        return JSON_SCHEMA_NOTE.format(schema=json.dumps(conversation.response_schema, ensure_ascii=False))
    return None


def _assistant_content(message: deepseek_recipe.Message) -> _Content:
    calls = [_native_tool_call(call.name, call.arguments) for call in message.tool_calls or []]
    parts = [message.content, *calls] if message.content else calls
    ends = itertools.accumulate((len(part) + (index > 0) for index, part in enumerate(parts)))
    return _Content("\n".join(parts), tool_call_ends=tuple(ends)[len(parts) - len(calls) :])


def _native_tool_call(name: str, arguments: str) -> str:
    """One call in the native format; arguments that are not JSON stay a JSON string, so the
    block still parses."""
    try:
        parsed_arguments = json.loads(arguments)
    except json.JSONDecodeError:
        parsed_arguments = arguments
    call = json.dumps({"name": name, "arguments": parsed_arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE}"
