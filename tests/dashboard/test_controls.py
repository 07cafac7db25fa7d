"""The dashboard's operator controls: buttons that call the existing services as the signed-in user,
disabled for users without the permission, whose POSTs are refused and change nothing; the scaling
timeline shows each event with the autoscaler's rule and figures."""

import pytest

from controlplane.topology.models import EngineInstance, Pool, ScalingEvent
from controlplane.topology.services import instance_register, pool_scale
from dashboard.figures import scaling_timeline

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool(make_pool):
    return make_pool("decode")


@pytest.fixture
def instance(pool):
    return instance_register(
        worker_id="decode-0",
        pool_name=pool.name,
        cluster_name=pool.cluster.name,
        role="decode",
        model=pool.model,
        hostname="host-a",
        request_endpoint="ipc:///tmp/sluice-dashboard-test.req",
        heartbeat_endpoint="ipc:///tmp/sluice-dashboard-test.hb",
    )


def state() -> tuple:
    return (
        list(Pool.objects.values_list("target_instances", "autoscale_paused")),
        list(EngineInstance.objects.values_list("state", flat=True)),
        ScalingEvent.objects.count(),
    )


def test_an_operator_scales_pauses_and_drains_from_the_page(client_as, pool, instance):
    operator = client_as("operator")

    page = operator.get("/dashboard/").content.decode()
    scaled = operator.post(f"/dashboard/pools/{pool.id}/scale/", {"target_instances": "2", "reason": "busy"})
    paused = operator.post(f"/dashboard/pools/{pool.id}/autoscale/", {"paused": "1"})
    drained = operator.post(f"/dashboard/instances/{instance.id}/drain/")
    after = operator.get("/dashboard/").content.decode()

    assert f'id="drain-{instance.id}"' in page and f'id="drain-{instance.id}" disabled' not in page
    assert [r.status_code for r in (scaled, paused, drained)] == [302, 302, 302]
    assert "pool test/decode scaled to 2" in after and "autoscaler paused on pool test/decode" in after
    assert f'id="resume-{instance.id}"' in after  # draining now: the button resumes it
    assert state()[:2] == ([(2, True)], ["draining"])
    assert list(ScalingEvent.objects.order_by("id").values_list("action", "actor_label", "reason"))[1:] == [
        ("pool_scaled", "operator-user", "busy"),
        ("autoscale_paused", "operator-user", "from the dashboard"),
        ("instance_drain_requested", "operator-user", "from the dashboard"),
    ]


@pytest.mark.parametrize("role", ["auditor", "admin"])
def test_controls_follow_the_permissions(client_as, pool, instance, role):
    client = client_as(role)

    page = client.get("/dashboard/").content.decode()

    disabled = f'id="drain-{instance.id}" disabled' in page and f'id="scale-{pool.id}" disabled' in page
    assert disabled == (role == "auditor")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("pools/{pool}/scale/", {"target_instances": "2"}),
        ("pools/{pool}/autoscale/", {"paused": "1"}),
        ("instances/{instance}/drain/", {}),
        ("instances/{instance}/resume/", {}),
    ],
)
def test_a_user_without_the_permission_is_refused_and_nothing_changes(client_as, pool, instance, path, body):
    auditor = client_as("auditor")
    before = state()

    response = auditor.post(f"/dashboard/{path.format(pool=pool.id, instance=instance.id)}", body)

    assert response.status_code == 403
    assert state() == before


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("pools/{pool}/scale/", {"target_instances": "99"}, "must be within 0..8"),
        ("pools/{pool}/scale/", {"target_instances": "two"}, "must be a whole number"),
        ("instances/{instance}/resume/", {}, "only a draining instance can resume"),
    ],
)
def test_a_refused_control_says_why_and_changes_nothing(client_as, pool, instance, path, body, message):
    operator = client_as("operator")
    before = state()

    response = operator.post(f"/dashboard/{path.format(pool=pool.id, instance=instance.id)}", body, follow=True)

    assert response.status_code == 200
    assert message in response.content.decode()
    assert state() == before


def test_controls_answer_posts_only_and_unknown_ids_are_404(client_as, pool):
    operator = client_as("operator")

    assert operator.get(f"/dashboard/pools/{pool.id}/scale/").status_code == 405
    assert operator.post("/dashboard/pools/999999/scale/", {"target_instances": "1"}).status_code == 404


def test_the_timeline_shows_the_autoscalers_rule_and_figures(pool):
    why = {
        "rule": "scale_up",
        "wanted": 3,
        "inputs": {
            "utilization": 1.2,
            "demands": {"requests_in_flight": {"mean": 70.0, "peak": 70.0, "per_worker": 64}},
        },
    }
    pool_scale(pool=pool, target_instances=3, actor=None, reason="autoscaler: scale_up", manual=False, why=why)

    figure = scaling_timeline(list(ScalingEvent.objects.all()))

    [trace] = figure.data
    assert trace.name == "pool_scaled"
    assert trace.text[0] == (
        "pool_scaled by system: autoscaler: scale_up<br>target 0 → 3"
        "<br>rule scale_up, wanted 3, utilization 1.2, requests_in_flight 70.0"
    )
