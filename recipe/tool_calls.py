"""Turns a ChatML model's native tool calls into the DSML markup deepseek-recipe's StreamProcessor parses.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (see recipe.chatml); the
processor reads DeepSeek's DSML:

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

(string values verbatim, other values as JSON). The adapter works on streamed text: plain text passes
through unchanged, except a tail that could still become `<tool_call>`, which is held back until it
is decided; a block is converted once its closing tag arrives. A block whose body is not a call
(malformed JSON, no name) passes through as the text it was.

Calls end a message: the processor ignores text after a DSML calls block. So once a call has been
converted, text between and after blocks is dropped here too, and later calls still join the same
calls block instead of being lost behind text.
"""

import json
from collections.abc import Mapping

import deepseek_recipe

from workers.protocol.messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

DEFAULT_DSML = deepseek_recipe.SpecialToken.Dsml.default_str()


class ToolCallAdapter:
    def __init__(self, *, starts_in_tool_call: bool, dsml: str = DEFAULT_DSML) -> None:
        """starts_in_tool_call: the prompt ended with `<tool_call>`, so the output begins with a body."""
        self._dsml = dsml
        self._undecided = ""  # text received but not yet passed on or converted
        self._in_call = starts_in_tool_call
        self._opened_by_prompt = starts_in_tool_call  # the current block's `<tool_call>` is not in the output
        self._calls_open = False  # a DSML calls block was emitted and not yet closed

    def push(self, text: str) -> str:
        """What the processor may be given now, for this much more model output."""
        self._undecided += text
        out: list[str] = []
        while True:
            if self._in_call:
                end = self._undecided.find(TOOL_CALL_CLOSE)
                if end == -1:
                    break
                out.append(self._converted(self._undecided[:end]))
                self._undecided = self._undecided[end + len(TOOL_CALL_CLOSE) :]
                self._in_call = self._opened_by_prompt = False
            else:
                start = self._undecided.find(TOOL_CALL_OPEN)
                if start == -1:
                    decided = len(self._undecided) - _open_tag_prefix_length(self._undecided)
                    out.append(self._plain(self._undecided[:decided]))
                    self._undecided = self._undecided[decided:]
                    break
                out.append(self._plain(self._undecided[:start]))
                self._undecided = self._undecided[start + len(TOOL_CALL_OPEN) :]
                self._in_call = True
        return "".join(out)

    def finish(self) -> str:
        """At the end of the output: an unclosed block or a held-back tail, as text, and the calls
        block closed."""
        unfinished = self._undecided
        if self._in_call and not self._opened_by_prompt:
            unfinished = TOOL_CALL_OPEN + unfinished
        self._undecided = ""
        self._in_call = False
        out = self._plain(unfinished)
        if self._calls_open:
            self._calls_open = False
            out += f"</{self._dsml} calls>"
        return out

    def _plain(self, text: str) -> str:
        """Text outside call blocks: passed on until the first call, dropped after it."""
        return "" if self._calls_open else text

    def _converted(self, body: str) -> str:
        calls = _parsed_calls(body)
        if calls is None:
            opener = "" if self._opened_by_prompt else TOOL_CALL_OPEN
            return self._plain(f"{opener}{body}{TOOL_CALL_CLOSE}")
        invokes = "".join(self._invoke(name, arguments) for name, arguments in calls)
        if self._calls_open:
            return invokes
        self._calls_open = True
        return f"<{self._dsml} calls>\n{invokes}"

    def _invoke(self, name: str, arguments: Mapping[str, object]) -> str:
        # The library renders an invoke without parameters with an empty line in between.
        parameters = "".join(f"{self._parameter(key, value)}\n" for key, value in arguments.items()) or "\n"
        return f'<{self._dsml} invoke name="{name}">\n{parameters}</{self._dsml} invoke>\n'

    def _parameter(self, key: str, value: object) -> str:
        is_string = isinstance(value, str)
        text = value if is_string else json.dumps(value, ensure_ascii=False)
        flag = "true" if is_string else "false"
        return f'<{self._dsml} parameter name="{key}" string="{flag}">{text}</{self._dsml} parameter>'


def _open_tag_prefix_length(text: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `<tool_call>`."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def _parsed_calls(body: str) -> list[tuple[str, dict]] | None:
    """The calls in a block body: one call object, or a list of them (SmolLM2's own format); None
    when the body is not that."""
    try:
        parsed = json.loads(body, parse_constant=_reject_non_json_constant)
    except ValueError:
        return None
    calls = [_parsed_call(item) for item in (parsed if isinstance(parsed, list) else [parsed])]
    if not calls or any(call is None for call in calls):
        return None
    return calls


def _parsed_call(item: object) -> tuple[str, dict] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (item["name"], arguments) if isinstance(arguments, dict) else None


def _reject_non_json_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")
