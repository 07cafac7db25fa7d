"""Every metric the Grafana dashboard (docker/grafana/dashboards/sluice.json) charts is in a running
gateway's /metrics: the real stack after one chat completion, read with Prometheus's text format
parser. A panel querying a name the gateway does not export would show "No data" forever."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.docker import monitoring_checks as checks
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow


def scrape(stack) -> str:
    response = httpx.get(f"{stack.base_url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def histogram_counts(text: str) -> dict[str, float]:
    """Each histogram family's observations (its `_count` summed over label sets)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            counts[family.name] = sum(s.value for s in family.samples if s.name == f"{family.name}_count")
    return counts


def test_every_metric_the_dashboard_queries_is_exported(stack):
    completion = stack.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to twenty."}], max_tokens=8
    )
    assert completion.usage.completion_tokens > 1
    queried = {name for expr in checks.panel_exprs(checks.load_dashboard()) for name in checks.metric_names(expr)}

    text = scrape(stack)
    families = checks.exposition_families(text)
    resolved = {name: checks.family_of(name, families) for name in sorted(queried)}

    assert [name for name, family in resolved.items() if family is None] == []
    # The request histograms the panels take percentiles of have the completion in them.
    histograms = {family for family in resolved.values() if families[family] == "histogram"}
    counts = histogram_counts(text)
    assert {family for family in histograms if counts[family] < 1} == set()
