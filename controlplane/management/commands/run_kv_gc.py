"""`python manage.py run_kv_gc --kv-store DIR [--kv-store-index URL] [--serve-index ipc://...]`: the KV
store's GC as a process of its own (workers.kvstore.gc_process), one per store, with the control
plane's TTL policy: read from the database before every run, so an admin's edit applies at the next
run (workers get theirs pushed over the control channel; this process has no such channel, and a
read every run is one small query). Each run's report is recorded for the dashboard and /metrics.
`serve` starts one for its store; `python -m workers.kvstore.gc_process` runs the same GC without
Django (TTL policy from --ttl-policy, reports in its log only).
"""

import argparse
import logging

from django.core.management.base import CommandError

from controlplane.common.connections import close_stale_connections
from controlplane.common.migrated import MigratedDatabaseCommand
from controlplane.policies.selectors import ttl_policy_current
from controlplane.telemetry.services import kv_store_gc_record
from workers.kvstore import gc_process
from workers.kvstore.gc_process import (
    StoreGCReport,
    add_store_gc_arguments,
    config_from_arguments,
    run_store_gc_process,
)
from workers.kvstore.ttl import TTLPolicy


class Command(MigratedDatabaseCommand):
    help = "Run the KV store's GC (TTL expiry, capacity watermark, stale checkpoints) until Ctrl-C."

    def add_arguments(self, parser) -> None:
        add_store_gc_arguments(parser, ttl_policy_option=False)

    def handle(self, *args, **options) -> None:
        try:
            config = config_from_arguments(argparse.Namespace(**options))
        except ValueError as error:
            raise CommandError(str(error)) from None
        # Each run's line (what it expired and evicted) is what this process has to say: shown whatever
        # level the rest of the control plane logs at (SLUICE_LOG_LEVEL).
        logging.getLogger(gc_process.__name__).setLevel(logging.INFO)
        run_store_gc_process(config, ttl_source=_ttl_policy, on_report=_record)


def _ttl_policy() -> TTLPolicy:
    close_stale_connections()
    policy = ttl_policy_current()
    policy.pop("revision")
    return TTLPolicy.from_dict(policy)


def _record(report: StoreGCReport) -> None:
    close_stale_connections()
    kv_store_gc_record(report=report)
