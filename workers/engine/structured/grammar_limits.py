"""A request's GrammarLimits applied to its output constraint: llguidance's own limits, and our check
of the counted repetitions in its patterns, which llguidance's lazy lexer would only meet while the
request runs (see workers.protocol.messages.GrammarLimits)."""

import re
from collections.abc import Iterator

import llguidance

from workers.protocol.messages import GrammarLimits

# {n}, {m,n} and {n,}: a count of repetitions. The count that costs is the largest one it allows:
# n, or m for {m,} (the unbounded rest is a star, which the lexer does not unroll).
_COUNTED_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# Escapes whose braces hold a name or a code point, not a count: \p{L}, \P{L}, \x{41}, \u{41}.
_BRACED_ESCAPES = frozenset("pPxu")


def parser_limits(limits: GrammarLimits) -> llguidance.LLParserLimits:
    # Errors without llguidance's dump of the parser state and grammar: they go back to the client.
    return llguidance.LLParserLimits(
        max_items_in_row=limits.max_items_in_row,
        initial_lexer_fuel=limits.initial_lexer_fuel,
        step_lexer_fuel=limits.step_lexer_fuel,
        step_max_items=limits.step_max_items,
        max_lexer_states=limits.max_lexer_states,
        max_grammar_size=limits.max_grammar_size,
        verbose_errors=False,
    )


def largest_repeat(pattern: str) -> int:
    """How many times the counted repetitions of `pattern` repeat what they apply to, nested ones
    multiplied: `a{3}` gives 3, `(a{10}b){20}` 200, a pattern without counts 1. Read leniently:
    what is not a well-formed count counts as a literal, and llguidance judges the syntax."""
    # Per open group: [the largest weight inside it so far, the weight of its last atom].
    groups = [[1, 1]]
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "(":
            groups.append([1, 1])
            index += 1
            continue
        if char == "{" and (count := _COUNTED_REPEAT.match(pattern, index)):
            weight = groups[-1][1] * int(count[2] or count[1])
            index = count.end()
        elif char == ")" and len(groups) > 1:
            weight = groups.pop()[0]
            index += 1
        elif char == "\\":
            weight, index = 1, _escape_end(pattern, index)
        elif char == "[":
            weight, index = 1, _class_end(pattern, index)
        else:
            weight, index = 1, index + 1
        groups[-1][0] = max(groups[-1][0], weight)
        groups[-1][1] = weight
    return max(best for best, _ in groups)


def schema_patterns(schema: object) -> Iterator[str]:
    """Every regex in a JSON Schema: `pattern` values and `patternProperties` names, at any depth."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from value
            yield from schema_patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from schema_patterns(item)


def _escape_end(pattern: str, index: int) -> int:
    end = index + 2
    if pattern[index + 1 : end] in _BRACED_ESCAPES and pattern[end : end + 1] == "{":
        close = pattern.find("}", end)
        return len(pattern) if close == -1 else close + 1
    return end


def _class_end(pattern: str, index: int) -> int:
    """The index after the character class opening at `index` (a `]` first in it is a literal;
    classes may nest, as in `[a-z&&[^aeiou]]`)."""
    index += 1
    if pattern[index : index + 1] == "^":
        index += 1
    if pattern[index : index + 1] == "]":
        index += 1
    depth = 1
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return len(pattern)
