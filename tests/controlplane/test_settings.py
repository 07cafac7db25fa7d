import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings import _grammar_limits, _worker_endpoints
from workers.protocol import GrammarLimits


def test_worker_endpoints_are_request_heartbeat_pairs():
    value = "ipc:///run/w0.req|ipc:///run/w0.hb, tcp://10.0.0.2:7100|tcp://10.0.0.2:7101,"

    assert _worker_endpoints(value) == [
        ("ipc:///run/w0.req", "ipc:///run/w0.hb"),
        ("tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101"),
    ]
    assert _worker_endpoints("") == []


@pytest.mark.parametrize("value", ["tcp://a:1", "tcp://a:1|", "|tcp://a:2", "a|b|c"])
def test_malformed_worker_endpoints_are_refused(value):
    with pytest.raises(ImproperlyConfigured):
        _worker_endpoints(value)


def test_grammar_limits_are_the_defaults_unless_the_environment_overrides_a_field():
    limits = _grammar_limits({"SLUICE_GRAMMAR_MAX_REGEX_REPEAT": "4000", "SLUICE_GRAMMAR_STEP_LEXER_FUEL": "400000"})

    assert limits == GrammarLimits(max_regex_repeat=4000, step_lexer_fuel=400_000)
    assert _grammar_limits({}) == GrammarLimits()


@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_a_grammar_limit_that_is_not_a_positive_integer_is_refused(value):
    with pytest.raises(ImproperlyConfigured, match="max_compile_ms"):
        _grammar_limits({"SLUICE_GRAMMAR_MAX_COMPILE_MS": value})
