"""Checks of the monitoring profile's files (docker/prometheus/, docker/grafana/), with no Docker,
Prometheus or Grafana: each returns the problems it found, naming the file or panel at fault."""

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "sluice.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"

# What PromQL text can hold besides metric names, removed before the names are read.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")
_IDENTIFIER = re.compile(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "group_left", "group_right"}
# The series Prometheus stores for a family, by the family's type, and the family each names.
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"), "counter": ("_total",)}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not a function or
    aggregation (followed by a parenthesis), a keyword, a label or a duration."""
    text = _STRING.sub('""', expr)
    for pattern in (_LABEL_MATCHERS, _RANGE, _GROUPING, _GRAFANA_VARIABLE):
        text = pattern.sub(" ", text)
    return {
        match.group()
        for match in _IDENTIFIER.finditer(text)
        if not text[match.end() :].lstrip().startswith("(") and match.group().lower() not in _KEYWORDS
    }


def family_of(name: str, families: dict[str, str]) -> str | None:
    """The family (in `families`, name to type) whose series `name` is: a gauge by its own name, a
    counter's `_total`, a histogram's `_bucket`, `_sum` or `_count`. None: no such family."""
    if families.get(name) not in (None, *_SUFFIXES):
        return name
    for kind, suffixes in _SUFFIXES.items():
        for suffix in suffixes:
            if name.endswith(suffix) and families.get(name.removesuffix(suffix)) == kind:
                return name.removesuffix(suffix)
    return None


def exposition_families(text: str) -> dict[str, str]:
    """{family name: type} of a /metrics text, as Prometheus's own text format parser reads it."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def provisioned_datasource_uids() -> set[str]:
    return {
        source["uid"]
        for file in sorted(DATASOURCES.glob("*.yml"))
        for source in yaml.safe_load(file.read_text()).get("datasources", [])
    }


def dashboard_problems(dashboard: dict, datasource_uids: set[str]) -> list[str]:
    """What Grafana needs of a provisioned dashboard: a uid and title; panels with unique ids, a type,
    a place on the grid and a title; each panel's targets with unique refIds and an expression, on a
    provisioned datasource."""
    problems = [f"dashboard: no {key}" for key in ("uid", "title", "schemaVersion") if not dashboard.get(key)]
    seen: set[int] = set()
    for panel in dashboard.get("panels", []):
        name = f"panel {panel.get('id')} ({panel.get('title')!r})"
        if not isinstance(panel.get("id"), int) or panel["id"] in seen:
            problems.append(f"{name}: its id is not a unique integer")
        seen.add(panel.get("id"))
        problems += [f"{name}: no {key}" for key in ("type", "title", "gridPos", "targets") if not panel.get(key)]
        refs = [target.get("refId") for target in panel.get("targets", [])]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"{name}: refIds {refs} are not unique")
        for target in panel.get("targets", []):
            if not target.get("expr", "").strip():
                problems.append(f"{name}: target {target.get('refId')} has no expr")
            for source in (panel.get("datasource"), target.get("datasource")):
                if not source or source.get("uid") not in datasource_uids:
                    problems.append(f"{name}: datasource {source} is not one provisioned ({sorted(datasource_uids)})")
    if not seen:
        problems.append("dashboard: no panels")
    return problems


def gateway_addresses(compose: dict) -> set[str]:
    """host:port of each gateway (a service that runs the ASGI application under uvicorn) on compose's
    network: the service name and the port uvicorn binds."""
    addresses = set()
    for name, service in compose["services"].items():
        argv = service.get("command") or []
        if "uvicorn" in argv and "controlplane.asgi:application" in argv:
            port = next(arg.removeprefix("--port=") for arg in argv if arg.startswith("--port="))
            addresses.add(f"{name}:{port}")
    return addresses


def scrape_problems(compose: dict, prometheus: dict) -> list[str]:
    """Every gateway scraped on /metrics, and no target that is not a gateway."""
    targets: set[str] = set()
    for job in prometheus.get("scrape_configs", []):
        if job.get("metrics_path", "/metrics") != "/metrics":
            continue
        for group in job.get("static_configs", []):
            targets |= set(group.get("targets", []))
    gateways = gateway_addresses(compose)
    problems = [f"prometheus.yml does not scrape gateway {address}" for address in sorted(gateways - targets)]
    problems += [f"prometheus.yml scrapes {address}, which is no gateway" for address in sorted(targets - gateways)]
    return problems


def mount_problems(compose: dict) -> list[str]:
    """The monitoring services mount the files this folder holds, where their configs look for them."""
    problems = []
    mounts = {
        name: dict(volume.split(":")[:2] for volume in compose["services"][name].get("volumes", []))
        for name in ("prometheus", "grafana")
    }
    expected = {
        "prometheus": {"./prometheus/prometheus.yml": "/etc/prometheus/prometheus.yml"},
        "grafana": {"./grafana/provisioning": "/etc/grafana/provisioning"},
    }
    for provider_file in sorted(DASHBOARD_PROVIDERS.glob("*.yml")):
        for provider in yaml.safe_load(provider_file.read_text()).get("providers", []):
            expected["grafana"]["./grafana/dashboards"] = provider["options"]["path"]
    for name, wanted in expected.items():
        for source, target in wanted.items():
            if mounts[name].get(source) != target:
                problems.append(f"{name}: does not mount {source} at {target}")
            if not (DOCKER / source).exists():
                problems.append(f"{name}: mounts {source}, which does not exist")
    for name in mounts:
        if compose["services"][name].get("profiles") != ["monitoring"]:
            problems.append(f"{name}: not in the monitoring profile only")
    return problems
