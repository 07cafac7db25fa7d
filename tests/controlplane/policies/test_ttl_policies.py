from unittest import mock

import pytest

from controlplane.common.errors import DomainValidationError
from controlplane.policies import tasks
from controlplane.policies.models import TrafficClass, TTLPolicy
from controlplane.policies.selectors import ttl_policy_current
from controlplane.policies.services import traffic_class_create, ttl_policy_set
from workers.kvstore.ttl import TTLPolicy as WorkerTTLPolicy


def test_the_migration_creates_agent_and_chat(db):
    assert set(TTLPolicy.objects.values_list("traffic_class__name", "version", "ttl_seconds")) == {
        ("agent", 1, 259_200),
        ("chat", 1, 604_800),
    }


def test_set_creates_a_new_version_and_never_edits(db, make_user):
    # given
    chat = TrafficClass.objects.get(name="chat")
    v1 = TTLPolicy.objects.get(traffic_class=chat)

    # when
    v2 = ttl_policy_set(traffic_class=chat, ttl_seconds=86_400, actor=make_user("admin"), reason="shorter")
    v3 = ttl_policy_set(traffic_class=chat, ttl_seconds=3_600, actor=None)

    # then
    assert (v2.version, v3.version) == (2, 3)
    assert (v2.created_by_label, v3.created_by_label) == ("admin-user", "system")
    v1.refresh_from_db()
    assert v1.ttl_seconds == 604_800
    assert ttl_policy_current()["ttl_s"]["chat"] == 3_600


@pytest.mark.parametrize("ttl", [0, -5])
def test_non_positive_ttl_is_a_field_error_and_changes_nothing(db, ttl):
    chat = TrafficClass.objects.get(name="chat")

    with pytest.raises(DomainValidationError) as raised:
        ttl_policy_set(traffic_class=chat, ttl_seconds=ttl, actor=None)

    assert list(raised.value.fields) == ["ttl_seconds"]
    assert TTLPolicy.objects.filter(traffic_class=chat).count() == 1


def test_current_policy_is_what_workers_decode(db):
    # given: a new version of agent, and a class with a policy of its own
    ttl_policy_set(traffic_class=TrafficClass.objects.get(name="agent"), ttl_seconds=7_200, actor=None)
    batch = traffic_class_create(name="batch", description="offline jobs")
    newest = ttl_policy_set(traffic_class=batch, ttl_seconds=600, actor=None)
    traffic_class_create(name="no-policy-yet")

    # when
    current = ttl_policy_current()

    # then
    assert current.pop("revision") == newest.pk
    policy = WorkerTTLPolicy.from_dict(current)
    assert policy.ttl_s == {"agent": 7_200, "chat": 604_800, "batch": 600}
    assert policy.default_class == "chat"
    assert policy.ttl_for("no-policy-yet") == 604_800


def test_the_push_is_queued_on_commit(db, django_capture_on_commit_callbacks):
    chat = TrafficClass.objects.get(name="chat")

    with mock.patch.object(tasks.ttl_policy_push_task, "delay") as delay:
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            ttl_policy_set(traffic_class=chat, ttl_seconds=60, actor=None)
        delay.assert_not_called()
        callbacks[0]()

    delay.assert_called_once_with()
