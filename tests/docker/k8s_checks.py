"""Checks of docker/k8s/ against Kubernetes' API schemas and against the code, with no cluster: each
returns the problems it found, each naming the object and container, as compose_checks does for
compose.yaml. The commands go through compose_checks' own checks (the real parsers): every container
is turned into the compose service it would be, with its environment and $(VAR) references resolved."""

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import yaml

from tests.docker import compose_checks
from tests.docker.compose_checks import _speaks_zmq_over_the_network

K8S = compose_checks.REPO / "docker" / "k8s"
# The one Secret every Django process reads, the one place external services are named.
CONFIG_SECRET = "sluice-config"
EXTERNAL_SERVICES = ("postgres.yaml", "redis.yaml")
# What the downward API gives a pod, for resolving $(VAR) references.
FIELD_VALUES = {"metadata.name": "pod-0", "status.podIP": "10.0.0.7"}
# Ports the third-party images listen on (sluice's come from their commands).
IMAGE_PORTS = {"postgres": {5432}, "redis": {6379}}
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = "nvidia.com/gpu.present"
WAIT_FOR_SCHEMA = ["python", "manage.py", "migrate", "--check"]
_REFERENCE = re.compile(r"\$\((\w+)\)")
_TCP_PORT = re.compile(r"^tcp://[^:/]+:(\d+)$")


def render(folder: Path = K8S, *, leave_out: tuple[str, ...] = ()) -> list[dict]:
    """The objects `kubectl kustomize` renders; without kubectl (or when leaving files out), the
    documents of the kustomization's resources as they are."""
    if shutil.which("kubectl") and not leave_out:
        text = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]
    resources = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    return [
        doc
        for name in resources
        if name not in leave_out
        for doc in yaml.safe_load_all((folder / name).read_text())
        if doc
    ]


def schema_problems(objects: list[dict], version: str) -> list[str]:
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            problems.append(f"{_name(obj)}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{_name(obj)}: {error.message}")
    return problems


@dataclass
class Container:
    """One container of a workload, its command and environment resolved as the kubelet would."""

    label: str  # Kind/name/container
    workload: dict
    spec: dict  # the container's own
    pod: dict  # the pod template's spec
    init: bool
    env: dict[str, str]
    argv: list[str]
    expansion_only: set[str]  # set only to be referenced as $(VAR), not read by the code

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"].get("metadata", {}).get("labels", {})

    @property
    def mounts(self) -> dict[str, dict]:
        return {m["mountPath"]: m for m in self.spec.get("volumeMounts", [])}

    def volume(self, mount_path: str) -> dict | None:
        mount = self.mounts.get(mount_path)
        volumes = {v["name"]: v for v in self.pod.get("volumes", [])}
        return volumes.get(mount["name"]) if mount else None

    @property
    def flags(self) -> dict[str, str]:
        return dict(arg.split("=", 1) for arg in self.argv if arg.startswith("--") and "=" in arg)


def containers(objects: list[dict], read: set[str]) -> Iterator[Container]:
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for init, key in ((True, "initContainers"), (False, "containers")):
            for spec in pod.get(key, []):
                env, referenced = _environment(spec, objects)
                argv = [_expand(arg, env) for arg in spec.get("command", []) + spec.get("args", [])]
                referenced |= {m for arg in spec.get("command", []) for m in _REFERENCE.findall(arg)}
                label = f"{_name(obj)}/{spec['name']}"
                yield Container(label, obj, spec, pod, init, env, argv, referenced - read)


def _environment(spec: dict, objects: list[dict]) -> tuple[dict[str, str], set[str]]:
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        kind, ref = ("Secret", source["secretRef"]) if "secretRef" in source else ("ConfigMap", source["configMapRef"])
        found = _find(objects, kind, ref["name"])
        env.update((found or {}).get("stringData") or (found or {}).get("data") or {})
    referenced = set()
    for variable in spec.get("env", []):
        value = variable.get("value")
        if value is None:
            value = FIELD_VALUES[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        referenced |= set(_REFERENCE.findall(value))
        env[variable["name"]] = _expand(value, env)
    return env, referenced


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it: a name it does not know stays as written."""
    return _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _find(objects: list[dict], kind: str, name: str) -> dict | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def _name(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def as_compose(items: list[Container]) -> dict:
    """The compose file these containers would be, for compose_checks' command and environment checks."""
    services = {}
    for c in items:
        env = {k: v for k, v in c.env.items() if k not in c.expansion_only}
        services[c.label] = {"image": c.spec["image"], "command": c.argv, "environment": env}
    return {"services": services}


def probe_commands(items: list[Container]) -> dict:
    """Exec probes of sluice containers as compose services (`sh -c` unwrapped), for command_problems."""
    services = {}
    for c in items:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            argv = c.spec.get(kind, {}).get("exec", {}).get("command")
            if argv and c.spec["image"].startswith("sluice"):
                argv = shlex.split(argv[2].replace("$HOSTNAME", "pod-0")) if argv[:2] == ["sh", "-c"] else argv
                services[f"{c.label} {kind}"] = {"image": c.spec["image"], "command": argv, "environment": c.env}
    return {"services": services}


def unresolved_references(items: list[Container]) -> list[str]:
    return [f"{c.label}: $({name}) is set nowhere" for c in items for arg in c.argv for name in _REFERENCE.findall(arg)]


def bound_ports(c: Container) -> set[int]:
    """The tcp ports the container's command binds (sluice) or its image listens on."""
    image = c.spec["image"].split(":")[0]
    if image in IMAGE_PORTS:
        return IMAGE_PORTS[image]
    ports = {int(m.group(1)) for v in c.flags.values() if (m := _TCP_PORT.match(v)) and "*" in v}
    if "--port" in c.flags:
        ports.add(int(c.flags["--port"]))
    return ports


def _container_port(c: Container, port) -> int | None:
    named = {p.get("name"): p["containerPort"] for p in c.spec.get("ports", [])}
    return named.get(port) if isinstance(port, str) else port


def port_problems(items: list[Container]) -> list[str]:
    """Declared container ports and every probe's port are ports the container binds."""
    problems = []
    for c in items:
        bound = bound_ports(c)
        for declared in c.spec.get("ports", []):
            if declared["containerPort"] not in bound:
                problems.append(f"{c.label}: declares port {declared['containerPort']}, its command binds {bound}")
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.spec.get(kind, {})
            for action in ("tcpSocket", "httpGet"):
                if action in probe and _container_port(c, probe[action]["port"]) not in bound:
                    problems.append(f"{c.label}: {kind} on port {probe[action]['port']}, its command binds {bound}")
    return problems


def service_ports(objects: list[dict], items: list[Container]) -> dict[tuple[str, int], set[int]]:
    """(Service, port) → the container ports it reaches in the pods it selects."""
    reached = {}
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        pods = [c for c in items if not c.init and selector <= c.labels.items()]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            reached[service["metadata"]["name"], port["port"]] = {
                p for c in pods if (p := _container_port(c, target)) in bound_ports(c)
            }
    return reached


def service_problems(objects: list[dict], items: list[Container]) -> list[str]:
    """Every Service port reaches a bound port, and every address a container is given (the registry,
    PostgreSQL, Redis) is a Service port that does."""
    reached = service_ports(objects, items)
    problems = [
        f"Service/{name}: port {port} reaches no bound container port" for (name, port), to in reached.items() if not to
    ]
    services = {name for name, _ in reached}
    for c in items:
        for value in [*c.flags.values(), *c.env.values()]:
            for address in value.split():
                parts = urlsplit(address.split("=", 1)[-1])
                if parts.scheme in ("tcp", "postgres", "redis") and parts.hostname in services:
                    if not reached.get((parts.hostname, parts.port or 0)):
                        problems.append(f"{c.label}: {address} is no port of Service/{parts.hostname}")
    return problems


def http_probe_problems(items: list[Container]) -> list[str]:
    """HTTP probe paths resolve in the URLconf and send a Host the gateway allows."""
    from django.urls import Resolver404, resolve

    problems = []
    for c in items:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c.spec.get(kind, {}).get("httpGet")
            if not get:
                continue
            try:
                resolve(get["path"])
            except Resolver404:
                problems.append(f"{c.label}: {kind} path {get['path']} is in no URLconf")
            host = next((h["value"] for h in get.get("httpHeaders", []) if h["name"] == "Host"), "<pod IP>")
            if host not in c.env.get("SLUICE_ALLOWED_HOSTS", "").split(","):
                problems.append(f"{c.label}: {kind} sends Host {host}, not in SLUICE_ALLOWED_HOSTS")
    return problems


def data_plane_key_problems(items: list[Container]) -> list[str]:
    """Every process that speaks ZMQ over the network reads SLUICE_CURVE_KEY_FILE from the Secret the
    key Job creates, mounted read-only, under the name the Job stores the exported file under."""
    creator = next((c for c in items if c.argv[:4] == ["kubectl", "create", "secret", "generic"]), None)
    export = next((c for c in items if c.argv[2:3] == ["export_data_plane_key"]), None)
    if creator is None or export is None:
        return ["no Job exports the data-plane key and stores it as a Secret"]
    secret = creator.argv[4]
    key, source = creator.flags["--from-file"].split("=", 1)
    problems = []
    folder = str(Path(source).parent)
    if export.argv[3] != source or creator.workload is not export.workload or creator.volume(folder) is None:
        problems.append(f"{creator.label}: stores {source}, which {export.label} does not write into its volume")
    elif creator.volume(folder) != export.volume(folder):
        problems.append(f"{creator.label}: reads {folder} from another volume than {export.label} writes")
    for c in items:
        if c.init or not _speaks_zmq_over_the_network(c.argv):
            continue
        path = c.env.get("SLUICE_CURVE_KEY_FILE")
        if not path:
            problems.append(f"{c.label}: speaks ZMQ over the network without SLUICE_CURVE_KEY_FILE")
            continue
        folder, name = str(Path(path).parent), Path(path).name
        volume = c.volume(folder) or {}
        if volume.get("secret", {}).get("secretName") != secret or name != key:
            problems.append(f"{c.label}: {path} is not key {key} of Secret {secret}")
        if not c.mounts.get(folder, {}).get("readOnly"):
            problems.append(f"{c.label}: mounts {folder} writable")
    return problems
