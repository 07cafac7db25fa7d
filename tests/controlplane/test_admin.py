"""The Django admin: every model of ours is registered and its pages render for an admin; scaling
events and data-plane keys are read-only there (no key's secret on any page); a tenant-role user cannot get in."""

import pytest
from django.contrib import admin
from django.urls import reverse
from django.utils.html import escape

from controlplane.topology.models import DataPlaneKey, ScalingEvent
from controlplane.topology.services import data_plane_key_create

OUR_APPS = {"tenants", "topology", "policies"}


def our_models():
    return [model for model in admin.site._registry if model._meta.app_label in OUR_APPS]


def test_every_model_of_ours_is_in_the_admin():
    from django.apps import apps

    ours = {model for label in OUR_APPS for model in apps.get_app_config(label).get_models()}
    assert ours == set(our_models())


@pytest.mark.parametrize("model", our_models(), ids=lambda model: model.__name__)
def test_changelist_and_add_pages_render_for_an_admin(client, django_user_model, make_instance, model):
    make_instance()  # a pool, an instance and a scaling event, so the lists have rows
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))
    meta = model._meta

    changelist = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
    add = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_add"))

    assert changelist.status_code == 200
    assert add.status_code in (200, 403)  # 403: rows made only by services elsewhere (keys, events)


def test_scaling_events_cannot_be_added_changed_or_deleted_in_the_admin(client, django_user_model, make_instance):
    make_instance()
    event = ScalingEvent.objects.first()
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))

    add = client.get(reverse("admin:topology_scalingevent_add"))
    change = client.post(reverse("admin:topology_scalingevent_change", args=[event.pk]), {"reason": "edited"})
    delete = client.post(reverse("admin:topology_scalingevent_delete", args=[event.pk]), {"post": "yes"})

    event.refresh_from_db()
    assert add.status_code == 403 and delete.status_code == 403
    assert change.status_code in (200, 403) and event.reason != "edited"
    assert ScalingEvent.objects.filter(pk=event.pk).exists()


def test_a_tenant_role_user_cannot_open_the_admin(client, make_user):
    client.force_login(make_user("tenant"))

    response = client.get(reverse("admin:topology_pool_changelist"))

    assert response.status_code in (302, 403)


def test_the_data_plane_key_pages_show_the_public_half_and_never_the_secret(client, django_user_model):
    key = data_plane_key_create()
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))

    changelist = client.get(reverse("admin:topology_dataplanekey_changelist"))
    change = client.get(reverse("admin:topology_dataplanekey_change", args=[key.pk]))
    delete = client.post(reverse("admin:topology_dataplanekey_delete", args=[key.pk]), {"post": "yes"})

    pages = changelist.content.decode() + change.content.decode()
    assert pages.count(escape(key.public_key)) >= 2  # Z85 has characters HTML escapes
    assert key.secret_key not in pages and escape(key.secret_key) not in pages
    assert delete.status_code == 403 and DataPlaneKey.objects.filter(pk=key.pk).exists()
