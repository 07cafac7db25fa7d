import json

import pytest
import torch

from workers.engine.structured.constraint import ConstraintError, TokenConstraint
from workers.engine.structured.grammar import compile_constraint
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import GrammarLimits, OutputConstraintSpec
from workers.text.tokenizer import Tokenizer

VOCAB = 49152
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        },
    ]
)


def drive(constraint: TokenConstraint, tokenizer: Tokenizer, text: str) -> None:
    """Feed `text` token by token, checking each token is allowed before it is consumed."""
    for token_id in tokenizer.encode(text):
        allowed = constraint.allowed_tokens()
        assert allowed.dtype == torch.bool and allowed.shape == (VOCAB,)
        assert allowed[token_id], f"{tokenizer.decode([token_id])!r} was refused after {text!r} began"
        constraint.advance(token_id)


def only_end_of_sequence_is_allowed(constraint: TokenConstraint, tokenizer: Tokenizer) -> bool:
    return set(constraint.allowed_tokens().nonzero().flatten().tolist()) == set(tokenizer.eos_token_ids)


def test_a_json_schema_output_is_followed_token_by_token(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("json", json.dumps(PERSON)), smollm2_tokenizer, VOCAB)

    drive(constraint, smollm2_tokenizer, '{"name": "Ada Lovelace", "age": 36}')

    assert constraint.is_finished()
    assert only_end_of_sequence_is_allowed(constraint, smollm2_tokenizer)


def test_the_mask_refuses_what_the_schema_does_not_allow(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("json", json.dumps(PERSON)), smollm2_tokenizer, VOCAB)
    drive(constraint, smollm2_tokenizer, '{"name": "Ada", "age": ')

    allowed = constraint.allowed_tokens()

    assert allowed[smollm2_tokenizer.encode("3")[0]]
    assert not allowed[smollm2_tokenizer.encode('"')[0]]
    assert not allowed[1]  # <|im_start|>: text never becomes a control token
    assert not constraint.is_finished()
    with pytest.raises(ConstraintError, match="not allowed"):
        constraint.advance(smollm2_tokenizer.encode('"')[0])
    constraint.advance(smollm2_tokenizer.encode("3")[0])  # a refused token left the state intact


def test_an_empty_schema_means_any_json_object(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("json", ""), smollm2_tokenizer, VOCAB)

    assert not constraint.allowed_tokens()[smollm2_tokenizer.encode("[")[0]]
    drive(constraint, smollm2_tokenizer, '{"anything": [1, 2.5, null, {"nested": true}]}')
    assert constraint.is_finished()


def test_a_regex_output(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(
        OutputConstraintSpec("regex", r"(yes|no), [0-9]{2} times"), smollm2_tokenizer, VOCAB
    )

    drive(constraint, smollm2_tokenizer, "yes, 42 times")

    assert constraint.is_finished()
    assert only_end_of_sequence_is_allowed(constraint, smollm2_tokenizer)


def test_a_required_tool_call_is_the_body_of_one_valid_call(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("tool_call_required", TOOLS), smollm2_tokenizer, VOCAB)

    # The prompt already ends with "<tool_call>": the output starts with the body.
    assert not constraint.allowed_tokens()[smollm2_tokenizer.encode("Sure")[0]]
    drive(constraint, smollm2_tokenizer, '{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')

    assert constraint.is_finished()
    assert only_end_of_sequence_is_allowed(constraint, smollm2_tokenizer)


def test_a_required_tool_call_must_match_the_tools_parameters(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("tool_call_required", TOOLS), smollm2_tokenizer, VOCAB)
    drive(constraint, smollm2_tokenizer, '{"name": "add", "arguments": {"a": ')

    allowed = constraint.allowed_tokens()

    assert not allowed[smollm2_tokenizer.encode('"')[0]]
    assert allowed[smollm2_tokenizer.encode("7")[0]]


def test_tool_arguments_hold_only_the_declared_parameters(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("tool_call_required", TOOLS), smollm2_tokenizer, VOCAB)
    drive(constraint, smollm2_tokenizer, '{"name": "get_weather", "arguments": {"city": "Paris"')

    allowed = constraint.allowed_tokens()

    assert allowed[smollm2_tokenizer.encode("}")[0]]
    assert not allowed[smollm2_tokenizer.encode(",")[0]]


def test_an_auto_tool_call_allows_text_or_text_then_valid_calls(smollm2_tokenizer: Tokenizer) -> None:
    text_only = compile_constraint(OutputConstraintSpec("tool_call", TOOLS), smollm2_tokenizer, VOCAB)
    drive(text_only, smollm2_tokenizer, "It is sunny, no <tool needed.")
    assert all(text_only.allowed_tokens()[token] for token in smollm2_tokenizer.eos_token_ids)

    with_call = compile_constraint(OutputConstraintSpec("tool_call", TOOLS), smollm2_tokenizer, VOCAB)
    drive(
        with_call,
        smollm2_tokenizer,
        'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    )
    allowed = with_call.allowed_tokens()
    assert all(allowed[token] for token in smollm2_tokenizer.eos_token_ids)
    assert not allowed[smollm2_tokenizer.encode("Done")[0]]  # nothing but calls after a call

    opened = compile_constraint(OutputConstraintSpec("tool_call", TOOLS), smollm2_tokenizer, VOCAB)
    drive(opened, smollm2_tokenizer, "<tool_call>")
    assert not opened.allowed_tokens()[smollm2_tokenizer.encode("I")[0]]  # an opened call must be valid JSON


def test_the_mask_covers_a_vocabulary_padded_past_the_tokenizer(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("regex", "a+"), smollm2_tokenizer, VOCAB + 64)

    allowed = constraint.allowed_tokens()

    assert allowed.shape == (VOCAB + 64,)
    assert not allowed[VOCAB:].any()


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (OutputConstraintSpec("json", '{"type": "integer", "minimum": "x"'), "invalid JSON schema: not JSON"),
        (OutputConstraintSpec("json", '{"type": "colour"}'), "invalid JSON schema: .*colour"),
        (OutputConstraintSpec("json", '{"type": "string", "pattern": "[a-"}'), "(?s)invalid JSON schema: .*unclosed"),
        (OutputConstraintSpec("regex", "(unclosed"), "invalid regular expression"),
        (OutputConstraintSpec("tool_call_required", "[]"), "non-empty list of tools"),
        (OutputConstraintSpec("tool_call", '[{"type": "function"}]'), "function tools with names"),
        (OutputConstraintSpec("grammar", "start: x"), "unknown output constraint kind"),
    ],
)
def test_a_bad_constraint_is_an_invalid_request(smollm2_tokenizer: Tokenizer, spec, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=problem):
        compile_constraint(spec, smollm2_tokenizer, VOCAB)


# The pattern: llguidance compiles it lazily, then runs out of lexer fuel on its second "bb".
EXPLODING = "^(a|aa)*b{50000}$"


def exploding_schema(pattern: str = EXPLODING) -> str:
    return json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    )


def exploding_tools() -> str:
    parameters = {"type": "object", "properties": {"s": {"type": "string", "pattern": EXPLODING}}}
    return json.dumps([{"type": "function", "function": {"name": "f", "parameters": parameters}}])


@pytest.mark.parametrize(
    "spec",
    [
        OutputConstraintSpec("json", exploding_schema()),
        OutputConstraintSpec("json", json.dumps({"type": "object", "patternProperties": {EXPLODING: {}}})),
        OutputConstraintSpec("regex", EXPLODING),
        OutputConstraintSpec("tool_call_required", exploding_tools()),
        OutputConstraintSpec("tool_call", exploding_tools()),
    ],
    ids=["json-pattern", "json-pattern-properties", "regex", "tools-required", "tools-auto"],
)
def test_a_pattern_repeating_past_the_limit_is_refused_before_any_token(smollm2_tokenizer: Tokenizer, spec) -> None:
    with pytest.raises(InvalidRequestError, match="repeats up to 50000 times; at most 1000 are allowed"):
        compile_constraint(spec, smollm2_tokenizer, VOCAB)


def test_the_repeat_limit_is_the_specs(smollm2_tokenizer: Tokenizer) -> None:
    pattern = "^x{1500}$"
    with pytest.raises(InvalidRequestError, match="repeats up to 1500"):
        compile_constraint(OutputConstraintSpec("regex", pattern), smollm2_tokenizer, VOCAB)

    roomy = OutputConstraintSpec("regex", pattern, GrammarLimits(max_regex_repeat=2000))
    assert not compile_constraint(roomy, smollm2_tokenizer, VOCAB).is_finished()


def test_a_grammar_that_exhausts_its_lexer_mid_output_fails_on_that_token(smollm2_tokenizer: Tokenizer) -> None:
    # given: the limit on repeats raised, so the grammar gets past admission
    spec = OutputConstraintSpec("json", exploding_schema(), GrammarLimits(max_regex_repeat=100_000))
    constraint = compile_constraint(spec, smollm2_tokenizer, VOCAB)
    drive(constraint, smollm2_tokenizer, '{"s": "aa')
    bb = smollm2_tokenizer.encode("bb")[0]

    # when / then: within a few tokens, as the engine calls it
    with pytest.raises(
        ConstraintError, match="^the output constraint failed: lexer error: too many expressions constructed$"
    ):
        for _ in range(3):
            assert constraint.allowed_tokens()[bb]
            constraint.advance(bb)
    with pytest.raises(ConstraintError, match="too many expressions constructed"):
        constraint.allowed_tokens()  # it stays failed
    assert not constraint.is_finished()


def test_too_many_earley_items_in_a_mask_fail_the_output_not_the_compile(smollm2_tokenizer: Tokenizer) -> None:
    spec = OutputConstraintSpec("json", json.dumps(PERSON), GrammarLimits(step_max_items=1))
    constraint = compile_constraint(spec, smollm2_tokenizer, VOCAB)

    with pytest.raises(ConstraintError, match="Too many items"):
        drive(constraint, smollm2_tokenizer, '{"name": "Ada", "age": 36}')


@pytest.mark.parametrize(
    ("limits", "problem"),
    [
        (GrammarLimits(max_grammar_size=5), "grammar size .* too big"),
        (GrammarLimits(initial_lexer_fuel=1), "initial lexer configuration .* too big"),
    ],
    ids=["grammar-size", "initial-lexer-fuel"],
)
def test_llguidance_limits_that_a_grammar_exceeds_at_compile_refuse_it(
    smollm2_tokenizer: Tokenizer, limits: GrammarLimits, problem: str
) -> None:
    with pytest.raises(InvalidRequestError, match=f"invalid JSON schema: {problem}"):
        compile_constraint(OutputConstraintSpec("json", json.dumps(PERSON), limits), smollm2_tokenizer, VOCAB)


def test_a_grammar_that_takes_longer_than_the_compile_limit_is_refused(smollm2_tokenizer: Tokenizer) -> None:
    # 200 tools of 10 parameters: hundreds of milliseconds to compile, against a limit of one.
    properties = {f"p{index}": {"type": "string"} for index in range(10)}
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": properties}}}
        for i in range(200)
    ]
    spec = OutputConstraintSpec("tool_call", json.dumps(tools), GrammarLimits(max_compile_ms=1))

    with pytest.raises(InvalidRequestError, match=r"invalid tools: it took \d+ ms to compile; the limit is 1 ms"):
        compile_constraint(spec, smollm2_tokenizer, VOCAB)


def test_a_draft_is_checked_and_its_masks_computed_without_moving_the_constraint(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("json", json.dumps(PERSON)), smollm2_tokenizer, VOCAB)
    drive(constraint, smollm2_tokenizer, '{"name": "Ada", "age": ')
    before = constraint.allowed_tokens()
    valid = smollm2_tokenizer.encode("36}")
    invalid = smollm2_tokenizer.encode('"x"')

    # how much of a draft the schema allows in turn, the state unchanged
    assert constraint.valid_prefix(valid) == len(valid)
    assert constraint.valid_prefix([*valid[:1], *invalid]) == 1
    assert torch.equal(constraint.allowed_tokens(), before)

    # the masks along a valid draft are those of consuming it token by token
    masks = constraint.masks_along(valid)
    assert len(masks) == len(valid) + 1 and torch.equal(masks[0], before)
    assert torch.equal(constraint.allowed_tokens(), before)
    for token_id, mask in zip(valid, masks, strict=False):
        assert torch.equal(constraint.allowed_tokens(), mask) and mask[token_id]
        constraint.advance(token_id)
    assert torch.equal(constraint.allowed_tokens(), masks[-1])
    assert constraint.is_finished() and only_end_of_sequence_is_allowed(constraint, smollm2_tokenizer)


def test_masks_along_a_draft_the_constraint_refuses_fail_and_leave_the_state(smollm2_tokenizer: Tokenizer) -> None:
    constraint = compile_constraint(OutputConstraintSpec("json", json.dumps(PERSON)), smollm2_tokenizer, VOCAB)
    drive(constraint, smollm2_tokenizer, '{"name": "Ada", "age": ')
    before = constraint.allowed_tokens()

    with pytest.raises(ConstraintError, match="not allowed"):
        constraint.masks_along([*smollm2_tokenizer.encode("3"), *smollm2_tokenizer.encode('"')])

    assert torch.equal(constraint.allowed_tokens(), before)
    drive(constraint, smollm2_tokenizer, "36}")
    assert constraint.is_finished()
