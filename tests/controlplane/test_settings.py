import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings import _grammar_limits, _positive_int, _request_limits, _worker_endpoints
from recipe.limits import RequestLimits
from workers.protocol.messages import GrammarLimits


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


def test_request_limits_default_to_the_recipes_and_each_is_set_by_its_own_variable():
    assert _request_limits({}) == RequestLimits()
    assert _request_limits({"SLUICE_MAX_TOOLS": "8", "SLUICE_MAX_JSON_DEPTH": "20"}) == RequestLimits(
        max_tools=8, max_json_depth=20
    )
    assert _request_limits({"SLUICE_IMAGE_FETCH_ALLOWED_NETWORKS": "10.0.0.0/8, fd00::/8"}) == RequestLimits(
        image_fetch_allowed_networks=("10.0.0.0/8", "fd00::/8")
    )


@pytest.mark.parametrize(
    "environ",
    [
        {"SLUICE_MAX_TOOLS": "many"},
        {"SLUICE_MAX_TOOLS": "0"},
        {"SLUICE_MAX_JSON_DEPTH": "500"},
        {"SLUICE_IMAGE_FETCH_ALLOWED_NETWORKS": "intranet"},
    ],
)
def test_request_limits_out_of_range_are_refused_at_start(environ):
    with pytest.raises(ImproperlyConfigured):
        _request_limits(environ)


def test_a_count_setting_is_its_default_unless_the_environment_sets_it():
    assert _positive_int({}, "SLUICE_PREPARE_THREADS", 2) == 2
    assert _positive_int({"SLUICE_PREPARE_THREADS": "4"}, "SLUICE_PREPARE_THREADS", 2) == 4


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_a_count_setting_that_is_not_a_positive_integer_is_refused_at_start(value):
    with pytest.raises(ImproperlyConfigured, match="SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT"):
        _positive_int({"SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT": value}, "SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT", 32)


def test_celery_beat_runs_both_periodic_ticks_and_each_names_a_registered_task():
    from controlplane.celery import app

    schedule = app.conf.beat_schedule

    assert set(schedule) == {"autoscale-tick", "ep-rebalance-tick"}
    assert all(entry["task"] in app.tasks for entry in schedule.values())
