"""Scaling events are only ever inserted. Refused: save() of an existing row, delete(), QuerySet
update()/delete(), and deleting what they point to. Not prevented: raw SQL (no database trigger)."""

import pytest
from django.db import connection
from django.db.models import ProtectedError

from controlplane.topology.models import ImmutableRowError, ScalingEvent
from controlplane.topology.services import pool_scale


@pytest.fixture
def event(make_pool, make_user) -> ScalingEvent:
    pool_scale(pool=make_pool(target_instances=1), target_instances=2, actor=make_user("operator"), reason="r")
    return ScalingEvent.objects.get()


def test_saving_an_existing_event_is_refused(event):
    event.reason = "rewritten"
    with pytest.raises(ImmutableRowError):
        event.save()
    assert ScalingEvent.objects.get().reason == "r"


def test_deleting_an_event_is_refused(event):
    with pytest.raises(ImmutableRowError):
        event.delete()
    with pytest.raises(ImmutableRowError):
        ScalingEvent.objects.filter(pk=event.pk).delete()
    with pytest.raises(ImmutableRowError):
        ScalingEvent._base_manager.all().delete()
    assert ScalingEvent.objects.count() == 1


def test_queryset_update_is_refused(event):
    with pytest.raises(ImmutableRowError):
        ScalingEvent.objects.update(reason="rewritten")
    assert ScalingEvent.objects.get().reason == "r"


def test_what_an_event_points_to_cannot_be_deleted(event):
    with pytest.raises(ProtectedError):
        event.pool.delete()
    with pytest.raises(ProtectedError):
        event.actor.delete()


def test_raw_sql_is_not_prevented(event):
    # Documented limit: nothing below the ORM guards the rows.
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {ScalingEvent._meta.db_table} SET reason = 'raw' WHERE id = %s", [event.pk])
    assert ScalingEvent.objects.get().reason == "raw"
