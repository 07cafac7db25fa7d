from django.contrib.auth.models import AnonymousUser, Group, User
from django.core.management import call_command

from controlplane.access.principals import TenantPrincipal, role_of
from controlplane.access.roles import sync_role_groups
from controlplane.tenants.services import api_key_create


def _codenames(role: str) -> set[str]:
    return set(Group.objects.get(name=role).permissions.values_list("content_type__app_label", "codename"))


def test_the_role_groups_exist_after_migrate(db):
    assert set(Group.objects.values_list("name", flat=True)) >= {"admin", "operator", "auditor", "tenant"}
    assert _codenames("tenant") == set()


def test_operators_scale_and_drain_but_cannot_change_ttl_policies(make_user):
    operator = make_user("operator")

    for perm in [
        "topology.scale_pool",
        "topology.change_pool",
        "topology.drain_engineinstance",
        "topology.stop_engineinstance",
        "topology.view_scalingevent",
        "policies.view_ttlpolicy",
    ]:
        assert operator.has_perm(perm), perm
    for perm in [
        "policies.add_ttlpolicy",
        "policies.change_ttlpolicy",
        "policies.apply_eplayout",
        "tenants.view_tenant",
    ]:
        assert not operator.has_perm(perm), perm


def test_auditors_only_view(make_user):
    perms = _codenames("auditor")

    assert perms and all(codename.startswith("view_") for _, codename in perms)
    assert {app for app, _ in perms} == {"topology", "policies", "tenants"}
    assert make_user("auditor").has_perm("tenants.view_apikey")


def test_admins_hold_every_permission_of_the_apps_including_custom_ones(make_user):
    perms = _codenames("admin")

    assert {("topology", "scale_pool"), ("policies", "apply_eplayout"), ("tenants", "delete_tenant")} <= perms
    assert ("auth", "add_user") not in perms


def test_sync_is_idempotent_and_restores_removed_permissions(db):
    operator = Group.objects.get(name="operator")
    before = _codenames("operator")
    operator.permissions.clear()
    operator.permissions.add(*Group.objects.get(name="admin").permissions.filter(codename="add_ttlpolicy"))

    sync_role_groups()
    sync_role_groups()

    assert _codenames("operator") == before
    assert Group.objects.filter(name="operator").count() == 1


def test_migrate_again_keeps_the_groups(db):
    call_command("migrate", verbosity=0)
    assert Group.objects.filter(name__in=["admin", "operator", "auditor", "tenant"]).count() == 4


def test_role_of(make_user, make_tenant):
    api_key, _ = api_key_create(tenant=make_tenant("acme"))
    principal = TenantPrincipal(tenant=api_key.tenant, api_key=api_key)
    superuser = User.objects.create_superuser(username="root", password="pw")
    inactive = make_user("operator", username="gone")
    inactive.is_active = False

    assert role_of(superuser) == "admin"
    assert role_of(make_user("operator")) == "operator"
    assert role_of(make_user("auditor")) == "auditor"
    assert role_of(make_user(None)) is None
    assert role_of(inactive) is None
    assert role_of(principal) == "tenant"
    assert role_of(AnonymousUser()) is None
    assert role_of(None) is None


def test_a_tenant_principal_has_no_django_permissions(make_tenant):
    api_key, _ = api_key_create(tenant=make_tenant("acme"), name="ci")
    principal = TenantPrincipal(tenant=api_key.tenant, api_key=api_key)

    assert principal.username == "tenant:acme"
    assert principal.is_authenticated and not principal.is_staff and not principal.is_superuser
    assert not principal.has_perm("topology.view_pool")
