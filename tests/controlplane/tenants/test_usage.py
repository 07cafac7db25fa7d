from datetime import date
from threading import Barrier, Thread

import pytest
from django.db import connection

from controlplane.common.errors import DomainValidationError
from controlplane.tenants.models import TenantUsage
from controlplane.tenants.selectors import tenant_tokens_used_today, tenant_usage_list, utc_today
from controlplane.tenants.services import tenant_create, tenant_update, tenant_usage_record


def test_repeated_recordings_add_up_in_one_row_per_day(make_tenant):
    # given
    tenant = make_tenant("acme")

    # when
    tenant_usage_record(tenant_id=tenant.pk, prompt_tokens=100, cached_tokens=80, completion_tokens=10)
    tenant_usage_record(tenant_id=tenant.pk, prompt_tokens=50, cached_tokens=0, completion_tokens=5)
    tenant_usage_record(
        tenant_id=tenant.pk, prompt_tokens=7, cached_tokens=0, completion_tokens=1, day=date(2026, 1, 1)
    )

    # then
    today = TenantUsage.objects.get(tenant=tenant, day=utc_today())
    assert (today.requests, today.prompt_tokens, today.cached_tokens, today.completion_tokens) == (2, 150, 80, 15)
    assert tenant_tokens_used_today(tenant_id=tenant.pk) == 165
    assert [row.day for row in tenant_usage_list(tenant_id=tenant.pk)] == [utc_today(), date(2026, 1, 1)]


def test_nothing_recorded_means_zero_used(make_tenant):
    assert tenant_tokens_used_today(tenant_id=make_tenant().pk) == 0


def test_negative_counts_are_refused(make_tenant):
    with pytest.raises(DomainValidationError) as raised:
        tenant_usage_record(tenant_id=make_tenant().pk, prompt_tokens=-1, cached_tokens=0, completion_tokens=0)
    assert list(raised.value.fields) == ["prompt_tokens"]
    assert not TenantUsage.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_recordings_lose_nothing(make_tenant):
    # given: threads that all record the first usage of the day at once
    tenant = make_tenant("acme")
    threads, barrier = 6, Barrier(6)

    def record() -> None:
        try:
            barrier.wait()
            for _ in range(5):
                tenant_usage_record(tenant_id=tenant.pk, prompt_tokens=10, cached_tokens=1, completion_tokens=2)
        finally:
            connection.close()

    # when
    workers = [Thread(target=record) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    # then
    usage = TenantUsage.objects.get(tenant=tenant)
    assert (usage.requests, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (30, 300, 30, 60)


def test_tenant_create_and_update_validate(db):
    tenant = tenant_create(name="acme", token_quota_per_day=1_000)
    assert tenant.token_quota_per_day == 1_000

    tenant_update(tenant=tenant, token_quota_per_day=None, rate_limit_rpm=5)
    tenant.refresh_from_db()
    assert (tenant.token_quota_per_day, tenant.rate_limit_rpm) == (None, 5)

    with pytest.raises(DomainValidationError) as raised:
        tenant_update(tenant=tenant, cache_namespace="x")
    assert list(raised.value.fields) == ["cache_namespace"]
    with pytest.raises(DomainValidationError) as raised:
        tenant_create(name="acme")
    assert list(raised.value.fields) == ["name"]
