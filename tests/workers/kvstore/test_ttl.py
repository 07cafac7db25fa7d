import msgspec
import pytest

from workers.kvstore.ttl import DAY_S, TTLPolicy


def test_defaults():
    policy = TTLPolicy()
    assert policy.ttl_for("agent") == 3 * DAY_S
    assert policy.ttl_for("chat") == 7 * DAY_S
    assert policy.default_class == "chat"


def test_unknown_class_gets_the_default_class_ttl():
    policy = TTLPolicy(ttl_s={"agent": 60.0, "batch": 10.0}, default_class="batch")
    assert policy.ttl_for("never-configured") == 10.0
    assert policy.ttl_for("agent") == 60.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl_s": {"chat": 0.0}}, "must be a positive number"),
        ({"ttl_s": {"chat": -5.0}}, "must be a positive number"),
        ({"ttl_s": {"chat": float("inf")}}, "must be a positive number"),
        ({"ttl_s": {"chat": 1.0, " ": 1.0}}, "non-empty"),
        ({"ttl_s": {"agent": 1.0}}, "default class 'chat' has no TTL"),
        ({"ttl_s": {}}, "default class 'chat' has no TTL"),
    ],
)
def test_invalid_policies_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TTLPolicy(**kwargs)


def test_dict_and_json_round_trip():
    policy = TTLPolicy(ttl_s={"agent": 3600.0, "chat": 86400.0, "batch": 600.0}, default_class="batch")
    assert TTLPolicy.from_dict(policy.to_dict()) == policy
    assert TTLPolicy.from_json(policy.to_json()) == policy
    assert policy.to_dict() == {"ttl_s": {"agent": 3600.0, "chat": 86400.0, "batch": 600.0}, "default_class": "batch"}


def test_from_dict_accepts_integer_seconds_and_fills_defaults():
    assert TTLPolicy.from_dict({"ttl_s": {"chat": 60}}).ttl_for("chat") == 60.0
    assert TTLPolicy.from_dict({}) == TTLPolicy()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"ttl_s": {"chat": -1}}, "positive"),
        ({"ttl_s": {"chat": 1}, "default_class": "agent"}, "default class 'agent'"),
        ({"ttl": {"chat": 1}}, "unknown field `ttl`"),
        ({"ttl_s": {"chat": "a week"}}, "Expected `float`"),
    ],
)
def test_decoding_validates(data, message):
    with pytest.raises(msgspec.ValidationError, match=message):
        TTLPolicy.from_dict(data)
