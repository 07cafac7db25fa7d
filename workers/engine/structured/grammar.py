"""Output constraints (`InferenceOptions.output_constraint`) compiled into token masks for the engine.

Built on llguidance: its Earley parser works lazily, computing only the parser and lexer states that
the output actually reaches, so nothing is compiled ahead of time for the whole grammar, and a large
JSON schema or a request's own tool list costs milliseconds to set up instead of seconds of automaton
building; JSON Schema, regular expressions and Lark grammars (with inline `%json` schemas, which the
tool-call grammars need) go through one engine; and masks are fast, computed by walking a token trie
(measured with SmolLM2's 49K vocabulary: 1-10 ms to compile, 0.1-0.3 ms per token mask).

Kinds (see workers.protocol.messages.OutputConstraintSpec):
- "json": the JSON Schema in `schema`, or any JSON object when it is "" (json_object mode);
- "regex": the pattern;
- "tool_call_required": the prompt already ends with `<tool_call>` (recipe.chatml), so the output
  is the body of one call to one of the listed tools, its arguments matching that tool's parameters
  schema (with no undeclared parameters), then `</tool_call>`, and nothing more;
- "tool_call" (what deepseek-recipe reports for tool_choice auto; a named tool comes as
  "tool_call_required" with that one tool): free text, until a `<tool_call>` commits the output to
  a call as above; more calls may follow, separated by at most a newline, and nothing else.
Once the grammar is complete, only an end-of-sequence token may follow.

Bounds (the spec's GrammarLimits, see workers.engine.structured.grammar_limits): a constraint that does not compile
within them, or whose first mask fails, raises InvalidRequestError here, before any token is
generated; one that exceeds them later, on the text generated so far, raises ConstraintError from
allowed_tokens() or advance(), and the engine ends that request alone.
"""

import json
import threading
import time
import weakref
from collections.abc import Iterable

import llguidance
import numpy as np
import torch

from workers.engine.structured.constraint import ConstraintError, TokenConstraint
from workers.engine.structured.grammar_limits import largest_repeat, parser_limits, schema_patterns
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, GrammarLimits, OutputConstraintSpec
from workers.text.tokenizer import Tokenizer

ANY_JSON_OBJECT = {"type": "object"}


class GrammarConstraint:
    """A TokenConstraint backed by an llguidance matcher; one per request."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed_tokens(self) -> torch.Tensor:
        return self._mask()

    def valid_prefix(self, token_ids: list[int]) -> int:
        valid = self._matcher.validate_tokens(token_ids)
        if self._matcher.is_error():
            raise ConstraintError(f"the output constraint failed: {_error(self._matcher)}")
        return valid

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        # Validated first: consuming a refused token would leave the matcher in its error state for good.
        valid = self.valid_prefix(token_ids)
        if valid < len(token_ids):
            raise ConstraintError(f"draft token {token_ids[valid]} is not allowed by the output constraint here")
        masks = []
        consumed = 0
        try:
            for token_id in token_ids:
                masks.append(self._mask())
                self._matcher.consume_token(token_id)
                consumed += 1
            masks.append(self._mask())
        finally:
            self._matcher.rollback(consumed)
        return masks

    def _mask(self) -> torch.Tensor:
        # The bitmask is little-endian 32-bit words, so byte k holds tokens 8k..8k+7, lowest bit first.
        # numpy unpacks it in microseconds; the same in torch ops took milliseconds.
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        # A matcher that hits a limit does not raise: it enters an error state for good.
        if self._matcher.is_error():
            raise ConstraintError(f"the output constraint failed: {_error(self._matcher)}")
        bits = np.unpackbits(packed, bitorder="little")
        allowed = np.zeros(self._vocab_size, dtype=np.bool_)
        # The model's vocabulary may be padded past the tokenizer's; those tokens are never allowed.
        covered = min(len(bits), self._vocab_size)
        allowed[:covered] = bits[:covered]
        return torch.from_numpy(allowed)

    def advance(self, token_id: int) -> None:
        # Validated first: a rejected token would leave the matcher in its error state for good.
        if self._matcher.validate_tokens([token_id]) == 1 and self._matcher.consume_token(token_id):
            return
        if self._matcher.is_error():  # a limit was hit, validating or consuming
            raise ConstraintError(f"the output constraint failed: {_error(self._matcher)}")
        raise ConstraintError(f"token {token_id} is not allowed by the output constraint here")

    def is_finished(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()


def compile_constraint(spec: OutputConstraintSpec, tokenizer: Tokenizer, vocab_size: int) -> TokenConstraint:
    """Raises InvalidRequestError for a schema, pattern or tool list that does not compile within the
    spec's limits."""
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
    what = _DESCRIPTIONS.get(spec.kind, spec.kind)
    guidance_tokenizer = _guidance_tokenizer(tokenizer)  # built once per tokenizer: not the grammar's cost
    started = time.perf_counter()
    grammar = _grammar(spec)
    limits = parser_limits(spec.limits)
    problem = llguidance.LLMatcher.validate_grammar(grammar, guidance_tokenizer, limits=limits)
    if problem:
        raise InvalidRequestError(f"invalid {what}: {_readable(problem)}")
    matcher = llguidance.LLMatcher(guidance_tokenizer, grammar, log_level=0, limits=limits)
    # The first mask builds the lexer's start state: a grammar too large to start fails here.
    matcher.compute_bitmask()
    if matcher.is_error():
        raise InvalidRequestError(f"invalid {what}: {_error(matcher)}")
    elapsed_ms = (time.perf_counter() - started) * 1000
    if elapsed_ms > spec.limits.max_compile_ms:
        raise InvalidRequestError(
            f"invalid {what}: it took {elapsed_ms:.0f} ms to compile; the limit is {spec.limits.max_compile_ms} ms"
        )
    return GrammarConstraint(matcher, vocab_size)


def _error(matcher: llguidance.LLMatcher) -> str:
    return _readable(matcher.get_error())


def _readable(message: str) -> str:
    """llguidance's message without the marker it leaves where verbose errors would dump its state."""
    return message.replace("<non-verbose/>", "").strip()


_DESCRIPTIONS = {
    "json": "JSON schema",
    "regex": "regular expression",
    "tool_call": "tools",
    "tool_call_required": "tools",
}


def _grammar(spec: OutputConstraintSpec) -> str:
    if spec.kind == "json":
        schema = _parsed_json(spec.schema, "JSON schema") if spec.schema else ANY_JSON_OBJECT
        _check_repeats(schema_patterns(schema), spec.limits, "JSON schema")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as error:
            raise InvalidRequestError(f"invalid JSON schema: {error}") from None
    if spec.kind == "regex":
        _check_repeats([spec.schema], spec.limits, "regular expression")
        return llguidance.LLMatcher.grammar_from_regex(spec.schema)
    if spec.kind == "tool_call_required":
        return llguidance.LLMatcher.grammar_from_lark(
            f"start: call_body {_lark_string(TOOL_CALL_CLOSE)}\n{_call_body_rule(spec.schema, spec.limits)}"
        )
    if spec.kind == "tool_call":
        # A lazy rule ends at the first `<tool_call>`, which commits the output to a call there.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: TEXT | text_then_open call_rest more_calls\n"
            f"text_then_open[lazy]: TEXT {_lark_string(TOOL_CALL_OPEN)}\n"
            f"call_rest: call_body {_lark_string(TOOL_CALL_CLOSE)}\n"
            f'more_calls: ("\\n"? {_lark_string(TOOL_CALL_OPEN)} call_rest)*\n'
            "TEXT: /(?s:.*)/\n"
            f"{_call_body_rule(spec.schema, spec.limits)}"
        )
    raise InvalidRequestError(f"unknown output constraint kind {spec.kind!r}")


def _call_body_rule(tools_json: str, limits: GrammarLimits) -> str:
    """`call_body`: {"name": <a listed tool>, "arguments": <that tool's parameters>}."""
    tools = _parsed_json(tools_json, "tools")
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("a tool-call constraint needs a non-empty list of tools")
    _check_repeats(schema_patterns(tools), limits, "tools")
    call_schemas = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"a tool-call constraint needs function tools with names, got {tool!r}")
        call_schemas.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": _declared_only(function.get("parameters") or ANY_JSON_OBJECT),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    return f"call_body: %json {json.dumps(schema)}\n"


def _check_repeats(patterns: Iterable[str], limits: GrammarLimits, what: str) -> None:
    for pattern in patterns:
        repeats = largest_repeat(pattern)
        if repeats > limits.max_regex_repeat:
            raise InvalidRequestError(
                f"invalid {what}: the pattern {pattern!r} repeats up to {repeats} times; "
                f"at most {limits.max_regex_repeat} are allowed"
            )


def _declared_only(parameters: object) -> object:
    """Arguments limited to the declared parameters, unless the schema says otherwise: a tool has no
    use for others, and a small model left free to add fields keeps inventing them (SmolLM2 filled
    max_tokens with made-up nested fields). OpenAI's strict mode closes objects the same way."""
    if isinstance(parameters, dict) and "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _parsed_json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"invalid {what}: not JSON: {error}") from None


def _lark_string(text: str) -> str:
    return json.dumps(text)


_tokenizers_lock = threading.Lock()
_guidance_tokenizers: "weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()


def _guidance_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """Built once per Tokenizer (about 0.2 s for a 49K vocabulary)."""
    with _tokenizers_lock:
        if tokenizer not in _guidance_tokenizers:
            _guidance_tokenizers[tokenizer] = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_TokenTable(tokenizer)), eos_token=sorted(tokenizer.eos_token_ids)
            )
        return _guidance_tokenizers[tokenizer]


class _TokenTable:
    """What llguidance reads from a tokenizer: every token's exact bytes, the special ids, and an
    encoder for text. Built from our Tokenizer (itself read from tokenizer.json) rather than a second
    parse of that file: the grammar sees exactly the bytes the detokenizer emits, text never encodes
    to control tokens, and it builds in 0.2 s where llguidance's own tokenizer.json path took 0.45 s."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(token_id) for token_id in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        automatic_prefix = self._tokenizer.encode("")
        return self._tokenizer.encode(text, allow_special=False)[len(automatic_prefix) :]
