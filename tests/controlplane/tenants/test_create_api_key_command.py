from io import StringIO

from django.core.management import call_command

from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.services import api_key_authenticate


def _create_api_key(tenant: str) -> list[str]:
    out = StringIO()
    call_command("create_api_key", "--tenant", tenant, stdout=out)
    return out.getvalue().splitlines()


def test_prints_a_working_key_as_the_last_line_and_creates_the_tenant(db):
    # when
    lines = _create_api_key("acme")

    # then
    api_key = api_key_authenticate(raw_key=lines[-1])
    assert api_key is not None and api_key.tenant.name == "acme"
    assert all(lines[-1] not in line for line in lines[:-1])


def test_a_second_key_for_the_same_tenant(db):
    # when
    first = _create_api_key("acme")[-1]
    second = _create_api_key("acme")[-1]

    # then
    assert first != second
    assert Tenant.objects.filter(name="acme").count() == 1
    assert ApiKey.objects.filter(tenant__name="acme").count() == 2
