"""`manage.py run_kv_gc` as a real process on the test database: it expires by the TTL policy the
control plane holds (an admin's edit included), reconciling with blocks other processes wrote, and
records a report of each run that the selectors and /metrics read."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families

from controlplane.policies.models import TrafficClass
from controlplane.policies.services import ttl_policy_set
from controlplane.telemetry.metrics import exposition
from controlplane.telemetry.models import KVStoreGC
from controlplane.telemetry.selectors import kv_store_gcs_reporting
from tests.waiting import wait_until
from workers.kvstore.store import open_store

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("default_ttl_policies")]

ROOT = Path(__file__).resolve().parents[3]


def database_url() -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def test_it_expires_by_the_control_planes_ttl_policy_and_reports_each_run(tmp_path, make_user):
    # given a store with chat and agent blocks (written by another process's store), and an admin
    # who shortened the chat TTL to one second
    directory = tmp_path / "kvstore"
    writer = open_store(directory)
    for i in range(3):
        writer.write(bytes([i]) * 16, b"chat" * 64, depth=i, traffic_class="chat")
    writer.write(b"a" * 16, b"agent" * 64, depth=0, traffic_class="agent")
    chat = TrafficClass.objects.get(name="chat")
    ttl_policy_set(traffic_class=chat, ttl_seconds=1, actor=make_user("admin"), reason="test")

    # when run_kv_gc runs on the store
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "run_kv_gc", f"--kv-store={directory}", "--kv-gc-interval=0.2"],
        env=dict(os.environ, DATABASE_URL=database_url(), PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: KVStoreGC.objects.filter(evicted_expired=3).exists() or process.poll() is not None)
        reporting = kv_store_gcs_reporting()
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0]

    # then the chat blocks are gone, the agent one kept, and its report says so
    assert process.returncode == 0, output
    assert [path.stem for path in directory.rglob("*.blk")] == [(b"a" * 16).hex()]
    assert "kv store gc: expired 3 (chat 3)" in output
    [gc] = reporting
    assert (gc.num_blocks, gc.evicted_expired, gc.evicted_capacity, gc.index_kind) == (1, 3, 0, "memory")
    assert gc.store == str(directory.resolve()) and gc.eviction_policy == "best"
    families = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(exposition([], [], reporting).decode())
        for sample in family.samples
    }
    assert families[("sluice:kv_store_gc_evictions_total", (("reason", "expired"), ("worker", gc.gc_id)))] == 3
    assert families[("sluice:kv_store_blocks", (("worker", gc.gc_id),))] == 1
    assert families[("sluice:kv_store_capacity_bytes", (("worker", gc.gc_id),))] == gc.capacity_bytes
