import pytest
from django.core.management import CommandError, call_command

from controlplane.topology.models import Node, Pool


@pytest.mark.django_db
def test_ensure_topology_creates_the_pools_and_the_agents_node():
    call_command("ensure_topology", "--node=agent-0", "--model=tiny", "--pool=prefill=1", "--pool=decode=2")

    assert sorted(Pool.objects.values_list("name", "kind", "min_instances")) == [
        ("decode", "decode", 2),
        ("prefill", "prefill", 1),
    ]
    assert list(Node.objects.values_list("hostname", flat=True)) == ["agent-0"]


@pytest.mark.django_db
def test_ensure_topology_sets_the_pools_precision():
    call_command("ensure_topology", "--node=agent-0", "--model=tiny", "--pool=mixed=1", "--kv-cache-dtype=fp8")

    assert Pool.objects.values_list("quantization", "kv_cache_dtype").get() == ("", "fp8")


@pytest.mark.django_db
def test_ensure_topology_refuses_an_unknown_pool_kind():
    with pytest.raises(CommandError, match="expected KIND=COUNT"):
        call_command("ensure_topology", "--node=agent-0", "--model=tiny", "--pool=prefil=1")
    assert not Pool.objects.exists()
