"""The monitoring profile checked without a daemon (tests/docker/monitoring_checks.py): the dashboard
is one Grafana can load on the provisioned datasource, Prometheus scrapes every gateway of
compose.yaml, and the services mount the files where their configs look."""

import copy

import pytest
import yaml

from tests.docker import compose_checks
from tests.docker import monitoring_checks as checks


@pytest.fixture(scope="module")
def compose() -> dict:
    env = compose_checks.read_env_file(checks.DOCKER / ".env.example")
    return compose_checks.load_compose(checks.DOCKER / "compose.yaml", env)


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load(checks.PROMETHEUS_CONFIG.read_text())


def test_the_dashboard_is_grafana_json_on_the_provisioned_datasource():
    assert checks.dashboard_problems(checks.load_dashboard(), checks.provisioned_datasource_uids()) == []


def test_duplicate_ids_refs_and_an_unknown_datasource_are_caught():
    broken = copy.deepcopy(checks.load_dashboard())
    broken["panels"][1]["id"] = broken["panels"][0]["id"]
    broken["panels"][2]["targets"].append(dict(broken["panels"][2]["targets"][0]))
    broken["panels"][3]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "elsewhere"}
    problems = checks.dashboard_problems(broken, checks.provisioned_datasource_uids())
    first, second, third, fourth = (f"panel {p['id']} ({p['title']!r})" for p in broken["panels"][:4])
    assert f"{second}: its id is not a unique integer" in problems
    assert any(p.startswith(f"{third}: refIds") for p in problems)
    assert any(p.startswith(f"{fourth}: datasource") and "'elsewhere'" in p for p in problems)


def test_every_gateway_is_scraped(compose, prometheus):
    assert checks.gateway_addresses(compose) == {"gateway-0:8000", "gateway-1:8000"}
    assert checks.scrape_problems(compose, prometheus) == []


def test_a_gateway_missing_from_the_targets_is_caught(compose, prometheus):
    bigger = copy.deepcopy(compose)
    bigger["services"]["gateway-2"] = copy.deepcopy(bigger["services"]["gateway-1"])
    assert checks.scrape_problems(bigger, prometheus) == ["prometheus.yml does not scrape gateway gateway-2:8000"]


def test_the_services_mount_the_config_and_dashboards_where_they_are_read(compose):
    assert checks.mount_problems(compose) == []


def test_metric_names_are_read_from_promql():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{pool=~"a|b"}'
        "[$__rate_interval]))) / on (pool) group_left max without (worker) (sluice:pool_load offset 5m) > bool 1e3"
    )
    assert checks.metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "sluice:pool_load"}


def test_series_names_resolve_to_their_families():
    families = {"h": "histogram", "c": "counter", "g": "gauge"}
    resolved = {name: checks.family_of(name, families) for name in ("h_bucket", "h_count", "c_total", "g")}
    assert resolved == {"h_bucket": "h", "h_count": "h", "c_total": "c", "g": "g"}
    # A histogram or counter by its bare name is no series Prometheus has.
    assert {checks.family_of(name, families) for name in ("h", "c", "g_total", "x")} == {None}


def test_every_panel_queries_something():
    dashboard = checks.load_dashboard()
    assert all(checks.metric_names(expr) for expr in checks.panel_exprs(dashboard))
