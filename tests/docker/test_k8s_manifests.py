"""docker/k8s/ validated against Kubernetes' API schemas and checked against the code, without a
cluster (tests/docker/k8s_checks.py; the commands go through compose_checks, as compose.yaml's do)."""

import copy

import kubernetes_validate
import pytest

from tests.docker import compose_checks
from tests.docker import k8s_checks as checks

# The oldest Kubernetes these manifests are meant for, and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
# Processes that serve nothing a probe could ask (with the Redis index the GC binds no socket): when
# their loop dies the process exits and the kubelet restarts it.
WITHOUT_LIVENESS = {"Deployment/celery-beat/celery-beat", "Deployment/kv-gc/kv-gc"}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return checks.render()


@pytest.fixture(scope="module")
def read() -> set[str]:
    return compose_checks.environment_read_by_code()


@pytest.fixture(scope="module")
def containers(objects, read) -> list[checks.Container]:
    return list(checks.containers(objects, read))


def _long_running(containers) -> list[checks.Container]:
    return [c for c in containers if not c.init and c.workload["kind"] != "Job"]


def _by_label(containers, label: str) -> checks.Container:
    return next(c for c in containers if c.label == label)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_api(objects, version):
    assert len(objects) > 20
    assert checks.schema_problems(objects, version) == []


def test_a_misspelt_field_is_caught(objects):
    broken = copy.deepcopy(objects)
    deployment = next(o for o in broken if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert any("livenesProbe" in p for p in checks.schema_problems(broken, KUBERNETES_VERSIONS[-1]))


def test_every_command_flag_and_probe_command_is_one_the_code_accepts(containers):
    assert checks.unresolved_references(containers) == []
    assert compose_checks.command_problems(checks.as_compose(containers)) == []
    assert compose_checks.command_problems(checks.probe_commands(containers)) == []


def test_a_wrong_worker_flag_is_caught(containers):
    broken = copy.deepcopy(_by_label(containers, "Deployment/decode/worker"))
    broken.argv.append("--kv-stor=/x")
    problems = compose_checks.command_problems(checks.as_compose([broken]))
    assert any(p.startswith("Deployment/decode/worker: manage.py run_worker refuses") for p in problems)


def test_every_variable_set_is_read_and_every_django_process_gets_the_config_secret(containers, read):
    assert compose_checks.environment_problems(checks.as_compose(containers), read) == []
    for c in containers:
        if c.spec["image"].startswith("sluice") and "SLUICE_CURVE_KEY_FILE" not in c.argv:
            sources = [s.get("secretRef", {}).get("name") for s in c.spec.get("envFrom", [])]
            assert checks.CONFIG_SECRET in sources or c.argv[:3] == ["python", "-m", "workers.engine.weights"], c.label


def test_an_unknown_variable_is_caught(containers, read):
    broken = copy.deepcopy(_by_label(containers, "Deployment/gateway/gateway"))
    broken.env["SLUICE_WORKER_ENDPOINT"] = "tcp://x:1|tcp://x:2"
    problems = compose_checks.environment_problems(checks.as_compose([broken]), read)
    assert any(p.startswith("Deployment/gateway/gateway: sets SLUICE_WORKER_ENDPOINT,") for p in problems)


def test_probe_and_service_ports_are_ports_the_commands_bind(objects, containers):
    assert checks.port_problems(containers) == []
    assert checks.service_problems(objects, containers) == []


def test_a_probe_on_a_port_nobody_binds_is_caught(objects, containers):
    broken = copy.deepcopy(_by_label(containers, "Deployment/registry/registry"))
    broken.argv[-1] = "--endpoint=tcp://*:7001"
    assert checks.port_problems([broken]) == [
        "Deployment/registry/registry: declares port 7000, its command binds {7001}",
        "Deployment/registry/registry: readinessProbe on port registry, its command binds {7001}",
        "Deployment/registry/registry: livenessProbe on port registry, its command binds {7001}",
    ]
    assert "Service/registry: port 7000 reaches no bound container port" in checks.service_problems(objects, [broken])


def test_an_address_no_service_answers_is_caught(objects, read):
    broken = copy.deepcopy(objects)
    checks._find(broken, "Secret", checks.CONFIG_SECRET)["stringData"]["SLUICE_KV_STORE_INDEX"] = "redis://redis:6380/1"
    problems = checks.service_problems(broken, list(checks.containers(broken, read)))
    assert "Deployment/decode/worker: redis://redis:6380/1 is no port of Service/redis" in problems


def test_http_probes_ask_paths_the_urlconf_serves(containers):
    assert checks.http_probe_problems(containers) == []
    broken = copy.deepcopy(_by_label(containers, "Deployment/gateway/gateway"))
    broken.spec["readinessProbe"]["httpGet"]["path"] = "/health"
    assert checks.http_probe_problems([broken]) == [
        "Deployment/gateway/gateway: readinessProbe path /health is in no URLconf"
    ]


def test_long_running_processes_have_liveness_and_services_readiness(objects, containers):
    long_running = _long_running(containers)
    assert {c.label for c in long_running if "livenessProbe" not in c.spec} == WITHOUT_LIVENESS
    behind_services = {
        c.label
        for service in (o for o in objects if o["kind"] == "Service")
        for c in long_running
        if service["spec"]["selector"].items() <= c.labels.items()
    }
    assert behind_services and all("readinessProbe" in _by_label(containers, label).spec for label in behind_services)


def test_workers_probe_their_request_socket(containers):
    workers = [c for c in containers if "run_worker" in c.argv]
    assert {c.label for c in workers} == {"Deployment/prefill/worker", "Deployment/decode/worker"}
    for c in workers:
        request_port = int(c.flags["--request-endpoint"].rsplit(":", 1)[1])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert checks._container_port(c, c.spec[kind]["tcpSocket"]["port"]) == request_port, (c.label, kind)


def test_engine_processes_get_a_gpu_on_a_gpu_node(containers):
    engines = [c for c in _long_running(containers) if "run_worker" in c.argv or "node.agent-0" in c.argv]
    assert len(engines) == 3
    for c in engines:
        assert c.spec["image"] == "sluice:cuda", c.label
        assert c.spec["resources"]["limits"][checks.GPU_RESOURCE] >= 1, c.label
        assert c.pod["nodeSelector"] == {checks.GPU_NODE_LABEL: "true"}, c.label
        device = c.flags.get("--device") or c.env.get("SLUICE_NODE_WORKER_OPTIONS", "")
        assert "cuda" in device, c.label


def test_the_kv_store_is_one_read_write_many_claim_every_worker_mounts(objects, containers):
    claim = checks._find(objects, "PersistentVolumeClaim", "kvstore")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    users = [
        c for c in containers if "--kv-store" in c.flags or "--kv-store=" in c.env.get("SLUICE_NODE_WORKER_OPTIONS", "")
    ]
    assert len(users) == 4  # prefill, decode, the node agent's workers, the GC
    for c in users:
        store = c.flags.get("--kv-store") or c.env["SLUICE_NODE_WORKER_OPTIONS"].split("--kv-store=")[1].split()[0]
        assert c.volume(store)["persistentVolumeClaim"]["claimName"] == "kvstore", c.label
        assert c.flags.get("--kv-gc-interval", "0") == "0" or "run_kv_gc" in c.argv


def test_the_data_plane_key_comes_from_a_secret_mounted_read_only(containers):
    assert checks.data_plane_key_problems(containers) == []
    broken = copy.deepcopy(containers)
    _by_label(broken, "Deployment/gateway/gateway").mounts["/var/lib/sluice/keys"]["readOnly"] = False
    del _by_label(broken, "Deployment/decode/worker").env["SLUICE_CURVE_KEY_FILE"]
    assert checks.data_plane_key_problems(broken) == [
        "Deployment/decode/worker: speaks ZMQ over the network without SLUICE_CURVE_KEY_FILE",
        "Deployment/gateway/gateway: mounts /var/lib/sluice/keys writable",
    ]


def test_every_django_process_waits_for_the_schema_and_what_it_loads(containers):
    for c in _long_running(containers):
        if not c.spec["image"].startswith("sluice"):
            continue
        inits = [i.argv for i in containers if i.init and i.workload is c.workload]
        assert inits[0] == checks.WAIT_FOR_SCHEMA, c.label
        if "/var/cache/sluice" in c.mounts:
            assert ["python", "-m", "workers.engine.weights", "smollm2-135m-instruct"] in inits, c.label
        if {"run_registry"} & set(c.argv) or "SLUICE_NODE_NAME" in c.env:
            assert any(argv[2:3] == ["ensure_topology"] for argv in inits), c.label


def test_topology_model_and_node_names_agree(containers):
    topology = [c for c in containers if c.argv[2:3] == ["ensure_topology"]]
    pools = {arg.split("=")[1] for c in topology for arg in c.argv if arg.startswith("--pool=")}
    models = {c.flags["--model"] for c in containers if "--model" in c.flags}
    models |= {c.argv[3] for c in containers if c.argv[:3] == ["python", "-m", "workers.engine.weights"]}
    models |= {c.env["SLUICE_MODELS"] for c in containers if "SLUICE_MODELS" in c.env}
    assert len(models) == 1
    assert {c.flags["--node"] for c in topology} == {
        c.env["SLUICE_NODE_NAME"] for c in containers if "SLUICE_NODE_NAME" in c.env
    }
    assert {c.flags["--pool"] for c in containers if "run_worker" in c.argv} <= pools


def test_without_the_bundled_postgres_and_redis_only_the_config_secret_names_them():
    objects = checks.render(leave_out=checks.EXTERNAL_SERVICES)
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            pod = obj["spec"]["template"]["spec"]
            for spec in pod.get("initContainers", []) + pod["containers"]:
                written = spec.get("command", []) + [v.get("value", "") for v in spec.get("env", [])]
                assert [w for w in written if "//postgres:" in w or "//redis:" in w] == [], spec["name"]
