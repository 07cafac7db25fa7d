"""/metrics through the real ASGI application shows what the autoscaler (or an operator) wants of each
pool against the instances it has, by state."""

import pytest

pytest.importorskip("recipe.api")  # the gateway's views need it

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from controlplane.topology.models import ScalingAction  # noqa: E402
from controlplane.topology.services import pool_autoscale_pause, pool_scale  # noqa: E402
from controlplane.topology.services.events import scaling_event_record  # noqa: E402


def test_desired_and_actual_instances_per_pool(api, make_pool, make_instance):
    # given a decode pool the autoscaler wants 3 of, with one ready and one draining instance
    pool = make_pool("decode", kind="decode", max_instances=4, target_instances=1)
    make_instance(pool)
    make_instance(pool, state="draining")
    pool_scale(pool=pool, target_instances=3, actor=None, manual=False)
    pool_autoscale_pause(pool=pool, paused=True, actor=None)

    response = api.request("GET", "/metrics")

    assert response.status_code == 200, response.text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name.startswith(("sluice:pool_desired", "sluice:pool_instances", "sluice:autoscaler"))
    }
    assert samples[("sluice:pool_desired_instances", (("pool", "test/decode"),))] == 3
    assert samples[("sluice:autoscaler_paused", (("pool", "test/decode"),))] == 1
    states = {
        dict(labels)["state"]: value for (name, labels), value in samples.items() if name == "sluice:pool_instances"
    }
    assert states == {"starting": 0, "ready": 1, "draining": 1, "stopped": 0, "failed": 0}


def test_scaling_events_are_counted_by_pool_and_action(api, make_pool, make_instance):
    # given a pool scaled twice and paused, an instance of it registered (an event of the instance
    # only), and an event of no pool at all
    pool = make_pool("decode", kind="decode", max_instances=4, target_instances=1)
    make_instance(pool)
    pool_scale(pool=pool, target_instances=2, actor=None, manual=False)
    pool_scale(pool=pool, target_instances=3, actor=None, manual=False)
    pool_autoscale_pause(pool=pool, paused=True, actor=None)
    scaling_event_record(action=ScalingAction.CONTROL_FAILED, actor=None, reason="no pool")

    response = api.request("GET", "/metrics")

    assert response.status_code == 200, response.text
    events = {
        (sample.labels["pool"], sample.labels["action"]): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "sluice:scaling_events_total"
    }
    assert events == {
        ("test/decode", "instance_registered"): 1,
        ("test/decode", "pool_scaled"): 2,
        ("test/decode", "autoscale_paused"): 1,
        ("", "control_failed"): 1,
    }
