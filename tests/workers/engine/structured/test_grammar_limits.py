import pytest

from workers.engine.structured.grammar_limits import largest_repeat, schema_patterns


@pytest.mark.parametrize(
    ("pattern", "repeats"),
    [
        ("abc", 1),
        ("^(a|aa)*b{50000}$", 50000),
        (r"\d{4}-\d{2}-\d{2}", 4),
        ("a{2,70}", 70),
        ("a{3,}", 3),  # the unbounded rest is a star, not unrolled
        ("(a{10}b){20}", 200),
        ("((a{2}){3}){4}", 24),
        ("(a|b{9})c", 9),
        (r"\p{L}{5}", 5),  # \p{L} names a class: its braces are no count
        (r"\x{41}", 1),
        ("[{500}]x", 1),  # braces in a class are characters
        ("[]{900}]", 1),  # a ] first in a class is one of its characters
        (r"\{500\}", 1),
        ("x{", 1),
        (")a{7}(", 7),  # unbalanced groups are llguidance's to refuse
    ],
)
def test_largest_repeat(pattern: str, repeats: int) -> None:
    assert largest_repeat(pattern) == repeats


def test_schema_patterns_finds_patterns_and_pattern_properties_at_any_depth() -> None:
    schema = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "pattern": "^a+$"},  # a property named "pattern" is no pattern
            "items": {"type": "array", "items": [{"patternProperties": {"^k{3}$": {"pattern": "v{2}"}}}]},
        },
    }

    assert sorted(schema_patterns(schema)) == ["^a+$", "^k{3}$", "v{2}"]
