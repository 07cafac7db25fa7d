import pytest

from controlplane.tenants.models import MAX_FAIR_SHARE_WEIGHT, ApiKey, Tenant
from controlplane.tenants.services import api_key_authenticate, api_key_create, tenant_usage_record
from tests.controlplane.api.helpers import assert_error


def _key_of(tenant: Tenant) -> ApiKey:
    return tenant.api_keys.get()


def test_admin_creates_a_tenant_and_edits_its_limits(client_as):
    admin = client_as("admin")

    created = admin.post("/api/v1/tenants/", {"name": "acme", "token_quota_per_day": 1000})
    assert created.status_code == 201, created.content
    tenant_id = created.json()["id"]
    updated = admin.patch(f"/api/v1/tenants/{tenant_id}/", {"rate_limit_rpm": 60})

    assert updated.status_code == 200, updated.content
    assert updated.json() | {"created_at": None} == {
        "id": tenant_id,
        "name": "acme",
        "rate_limit_rpm": 60,
        "token_quota_per_day": 1000,
        "share_prefix_cache": False,
        "max_requests_in_flight": None,
        "max_queued_prompt_tokens": None,
        "fair_share_weight": 1,
        "created_at": None,
    }


def test_admin_sets_a_tenants_admission_caps_and_weight(client_as, make_tenant):
    tenant = make_tenant("acme")
    admin = client_as("admin")
    fields = {"max_requests_in_flight": 4, "max_queued_prompt_tokens": 20_000, "fair_share_weight": 3}

    updated = admin.patch(f"/api/v1/tenants/{tenant.id}/", fields)
    created = admin.post("/api/v1/tenants/", {"name": "globex", **fields})

    assert updated.status_code == 200, updated.content
    assert created.status_code == 201, created.content
    tenant.refresh_from_db()
    assert (tenant.max_requests_in_flight, tenant.max_queued_prompt_tokens, tenant.fair_share_weight) == (4, 20_000, 3)
    assert {name: created.json()[name] for name in fields} == fields
    # Empty again: back to the gateway's defaults.
    cleared = admin.patch(f"/api/v1/tenants/{tenant.id}/", {"max_requests_in_flight": None})
    assert cleared.status_code == 200 and cleared.json()["max_requests_in_flight"] is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_requests_in_flight", 0),
        ("max_requests_in_flight", -1),
        ("max_requests_in_flight", "many"),
        ("max_queued_prompt_tokens", 0),
        ("fair_share_weight", 0),
        ("fair_share_weight", MAX_FAIR_SHARE_WEIGHT + 1),
        ("fair_share_weight", None),
    ],
)
def test_an_invalid_cap_or_weight_is_a_field_error_and_changes_nothing(client_as, make_tenant, field, value):
    tenant = make_tenant("acme")

    response = client_as("admin").patch(f"/api/v1/tenants/{tenant.id}/", {field: value}, format="json")

    assert set(assert_error(response, 400, "validation_error")["fields"]) == {field}
    unchanged = Tenant.objects.get(pk=tenant.pk)
    assert (unchanged.max_requests_in_flight, unchanged.max_queued_prompt_tokens, unchanged.fair_share_weight) == (
        None,
        None,
        1,
    )


@pytest.mark.parametrize("role", ["tenant:acme", "operator", "auditor"])
def test_only_admins_change_caps_and_weights(client_as, make_tenant, role):
    tenant = make_tenant("acme")

    response = client_as(role).patch(f"/api/v1/tenants/{tenant.id}/", {"fair_share_weight": 1000})

    assert response.status_code == 403, response.content
    assert_error(response, 403, "permission_denied")
    tenant.refresh_from_db()
    assert tenant.fair_share_weight == 1


def test_a_duplicate_tenant_name_is_a_field_error(client_as, make_tenant):
    make_tenant("acme")

    response = client_as("admin").post("/api/v1/tenants/", {"name": "acme"})

    assert "name" in assert_error(response, 400, "validation_error")["fields"]
    assert Tenant.objects.filter(name="acme").count() == 1


def test_the_raw_key_is_shown_once_at_creation_and_never_its_hash(client_as, make_tenant):
    # given
    tenant = make_tenant("acme")
    admin = client_as("admin")

    # when
    created = admin.post("/api/v1/keys/", {"tenant": tenant.id, "name": "ci"})

    # then
    assert created.status_code == 201, created.content
    raw_key = created.json()["key"]
    assert api_key_authenticate(raw_key=raw_key).tenant == tenant
    listed = admin.get("/api/v1/keys/").json()["results"]
    assert [key["name"] for key in listed] == ["ci"]
    assert "key" not in listed[0] and "key_hash" not in listed[0]
    assert raw_key not in admin.get(f"/api/v1/keys/{created.json()['id']}/").content.decode()


def test_a_tenant_sees_only_its_own_keys(client_as, make_tenant):
    # given
    acme = client_as("tenant:acme")
    api_key_create(tenant=make_tenant("acme"), name="second")
    api_key_create(tenant=make_tenant("globex"))

    # when
    listed = acme.get("/api/v1/keys/").json()

    # then
    assert listed["count"] == 2
    assert {key["tenant_name"] for key in listed["results"]} == {"acme"}


def test_another_tenants_key_is_not_found_and_stays_unrevoked(client_as, make_tenant):
    # given
    acme = client_as("tenant:acme")
    globex_key, _ = api_key_create(tenant=make_tenant("globex"))

    # when / then
    assert_error(acme.get(f"/api/v1/keys/{globex_key.id}/"), 404, "not_found")
    assert_error(acme.post(f"/api/v1/keys/{globex_key.id}/revoke/"), 404, "not_found")
    globex_key.refresh_from_db()
    assert globex_key.revoked_at is None


def test_a_tenant_cannot_even_filter_by_another_tenant(client_as, make_tenant):
    acme = client_as("tenant:acme")
    globex = make_tenant("globex")

    assert "tenant" in assert_error(acme.get(f"/api/v1/keys/?tenant={globex.id}"), 400, "validation_error")["fields"]


def test_a_revoked_key_fails_on_its_very_next_request(client_as, make_tenant):
    # given
    acme = client_as("tenant:acme")
    key = _key_of(make_tenant("acme"))

    # when
    revoked = acme.post(f"/api/v1/keys/{key.id}/revoke/")

    # then
    assert revoked.status_code == 200, revoked.content
    assert revoked.json()["revoked_at"] is not None
    assert_error(acme.get("/api/v1/keys/"), 401, "authentication_error")


def test_admin_filters_keys_by_tenant_and_revocation(client_as, make_tenant):
    admin = client_as("admin")
    acme, globex = make_tenant("acme"), make_tenant("globex")
    revoked, _ = api_key_create(tenant=acme)
    api_key_create(tenant=acme)
    api_key_create(tenant=globex)
    admin.post(f"/api/v1/keys/{revoked.id}/revoke/")

    assert admin.get(f"/api/v1/keys/?tenant={acme.id}").json()["count"] == 2
    assert [key["id"] for key in admin.get("/api/v1/keys/?revoked=true").json()["results"]] == [revoked.id]


def test_a_tenant_sees_only_its_own_usage_and_admins_see_all(client_as, make_tenant):
    # given
    acme_client = client_as("tenant:acme")
    acme, globex = make_tenant("acme"), make_tenant("globex")
    tenant_usage_record(tenant_id=acme.id, prompt_tokens=100, cached_tokens=60, completion_tokens=10)
    tenant_usage_record(tenant_id=globex.id, prompt_tokens=5, cached_tokens=0, completion_tokens=5)

    # when
    own = acme_client.get("/api/v1/usage/").json()["results"]
    everyone = client_as("auditor").get("/api/v1/usage/").json()["results"]
    filtered = client_as("admin").get(f"/api/v1/usage/?tenant={globex.id}").json()["results"]

    # then
    assert [(row["tenant"], row["requests"], row["cached_tokens"], row["total_tokens"]) for row in own] == [
        (acme.id, 1, 60, 110)
    ]
    assert {row["tenant"] for row in everyone} == {acme.id, globex.id}
    assert [row["tenant"] for row in filtered] == [globex.id]
    globex_row = everyone[[row["tenant"] for row in everyone].index(globex.id)]
    assert_error(acme_client.get(f"/api/v1/usage/{globex_row['id']}/"), 404, "not_found")
