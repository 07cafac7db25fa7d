"""The vision-encoder pool kind, once stored as "ve", is "encode" (the encode workers' role) after
topology's migration 0005, and "ve" again when it is migrated back; other kinds stay as they were."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("topology", "0004_pool_precision")]
AFTER = [("topology", "0005_pool_kind_encode")]


def _migrate(targets):
    """Migrates to `targets`; returns the models as they are there."""
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    return MigrationExecutor(connection).loader.project_state(targets).apps


def _kinds(apps) -> dict[str, str]:
    return dict(apps.get_model("topology", "Pool").objects.values_list("name", "kind"))


@pytest.mark.django_db(transaction=True)
def test_ve_pools_become_encode_pools_and_back():
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes("topology")
    try:
        # given pools written before the rename: a vision-encoder pool stored as "ve", and a prefill pool
        old = _migrate(BEFORE)
        cluster = old.get_model("topology", "Cluster").objects.create(name="c")
        pool = old.get_model("topology", "Pool")
        pool.objects.create(cluster=cluster, name="vision", kind="ve", model="smolvlm")
        pool.objects.create(cluster=cluster, name="prefill", kind="prefill", model="smolvlm")

        # when the topology is migrated forwards, then the encoder pool has the encode role's kind
        assert _kinds(_migrate(AFTER)) == {"vision": "encode", "prefill": "prefill"}

        # and migrating back restores what was stored
        assert _kinds(_migrate(BEFORE)) == {"vision": "ve", "prefill": "prefill"}
    finally:
        _migrate(leaf)
