"""Checks of docker/ against the code, with no Docker daemon: each returns the problems it found, each
naming the service and what is wrong, so a test failure says exactly what to fix."""

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from django.core.management import get_commands, load_command_class

REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("controlplane", "workers", "kernels", "recipe", "dashboard")
# Read by the Python interpreter, not by our code (the Dockerfiles set them).
INTERPRETER_ENV = {"PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "TRITON_CACHE_DIR"}
# What every Django process of a multi-host cluster must be given: without them each container would
# use its own SQLite file, the embedded secret key, and run control tasks in-process.
REQUIRED_DJANGO_ENV = {"DATABASE_URL", "SLUICE_SECRET_KEY", "SLUICE_CELERY_BROKER_URL"}
NODE_AGENT_ENV = {"SLUICE_NODE_NAME", "SLUICE_REGISTRY_ENDPOINT", "SLUICE_NODE_RUNTIME_DIR"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default} and ${NAME:?error}, from `env` (docker/.env)."""
    return _VARIABLE.sub(lambda m: env.get(m.group(1), m.group(2) or ""), text).replace("$$", "$")


def load_compose(path: Path, env: dict[str, str]) -> dict:
    return yaml.safe_load(interpolate(path.read_text(), env))


def read_env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def compose_variables(path: Path) -> set[str]:
    return {m.group(1) for m in _VARIABLE.finditer(path.read_text())}


def environment_read_by_code() -> set[str]:
    """Every variable our code reads: literal names in os.environ / os.getenv calls and subscripts
    anywhere, and the names settings.py looks up while it loads (the SLUICE_MAX_* and SLUICE_GRAMMAR_*
    families are built from fields), recorded by importing it under a recording environment."""
    names: set[str] = set()
    for folder in CODE_DIRS:
        for file in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                reads_env = (
                    isinstance(node, ast.Call)
                    and "environ" in ast.unparse(node.func) + "".join(ast.unparse(a) for a in node.args)
                    or (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.getenv")
                )
                if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                    reads_env, node = True, ast.Call(func=node.value, args=[node.slice], keywords=[])
                if reads_env:
                    for arg in node.args:
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.isupper():
                            names.add(arg.value)
    script = (
        "import os, sys\n"
        "class Recording(dict):\n"
        "    seen = set()\n"
        "    def __getitem__(self, k): self.seen.add(k); return super().__getitem__(k)\n"
        "    def get(self, k, d=None): self.seen.add(k); return super().get(k, d)\n"
        "    def __contains__(self, k): self.seen.add(k); return super().__contains__(k)\n"
        "os.environ = Recording(os.environ)\n"
        "import controlplane.settings\n"
        "print('\\n'.join(sorted(Recording.seen)))\n"
    )
    env = {**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return names | set(out.stdout.split())


def _manage_parser(name: str):
    commands = get_commands()
    if name not in commands:
        return None
    return load_command_class(commands[name], name).create_parser("manage.py", name)


def _parse(parser, argv: list[str]) -> str | None:
    """argparse's complaint about argv, or None."""
    messages = []
    parser.error = lambda message: (messages.append(message), (_ for _ in ()).throw(SystemExit(2)))
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(SystemExit(status))
    try:
        parser.parse_args(argv)
    except SystemExit:
        return messages[0] if messages else "exited"
    return None


def _click_problem(command, argv: list[str], obj=None) -> str | None:
    import click

    try:
        command.make_context(command.name or "command", list(argv), obj=obj)
    except click.ClickException as error:
        return error.format_message()
    except click.exceptions.Exit:
        return None
    return None


def _sluice_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("sluice")}


def command_problems(compose: dict) -> list[str]:
    """Each sluice service's command: manage.py commands and their flags, python -m modules, the
    uvicorn target and its options, Celery's app, subcommand, flags and queues."""
    from celery.app.utils import find_app
    from celery.bin.celery import celery as celery_cli
    from uvicorn.importer import import_from_string
    from uvicorn.main import main as uvicorn_cli

    from controlplane.celery import app as celery_app
    from controlplane.topology.services import node_queue
    from workers.worker.args import add_worker_arguments

    problems = []
    for name, service in _sluice_services(compose).items():
        argv = service.get("command")
        if not isinstance(argv, list):
            problems.append(f"{name}: command must be a list (exec form), got {argv!r}")
            continue
        env = service.get("environment") or {}
        if argv[:2] == ["python", "manage.py"]:
            parser = _manage_parser(argv[2])
            if parser is None:
                problems.append(f"{name}: manage.py has no command {argv[2]!r}")
            elif error := _parse(parser, argv[3:]):
                problems.append(f"{name}: manage.py {argv[2]} refuses {argv[3:]}: {error}")
        elif argv[:3] == ["python", "-m", "uvicorn"]:
            if error := _click_problem(uvicorn_cli, argv[3:]):
                problems.append(f"{name}: uvicorn refuses {argv[3:]}: {error}")
            for arg in argv[3:]:
                target = arg.removeprefix("--http=") if arg.startswith("--http=") else arg
                if ":" in target and not target.startswith("-"):
                    try:
                        import_from_string(target)
                    except Exception as error:
                        problems.append(f"{name}: uvicorn cannot import {target!r}: {error}")
        elif argv[:2] == ["python", "-m"]:
            if importlib.util.find_spec(argv[2]) is None:
                problems.append(f"{name}: no module {argv[2]!r} to run")
        elif argv[0] == "celery":
            problems += _celery_problems(name, argv, env, celery_cli, find_app, celery_app, node_queue)
        else:
            problems.append(f"{name}: unknown program {argv[0]!r}")
        if options := env.get("SLUICE_NODE_WORKER_OPTIONS"):
            parser = _argparse_for(add_worker_arguments)
            given = shlex.split(options)
            argv = [*given, "--model=m", "--request-endpoint=x", "--heartbeat-endpoint=y"]
            if error := _parse(parser, argv):
                problems.append(f"{name}: SLUICE_NODE_WORKER_OPTIONS {given} refused by workers.worker: {error}")
    return problems


def _argparse_for(add):
    import argparse

    parser = argparse.ArgumentParser()
    add(parser)
    return parser


def _celery_problems(name, argv, env, celery_cli, find_app, celery_app, node_queue) -> list[str]:
    problems = []
    if argv[1:3] != ["-A", "controlplane"] or find_app("controlplane") is not celery_app:
        problems.append(f"{name}: celery must name the app with -A controlplane (controlplane.celery.app), got {argv}")
        return problems
    sub, rest = argv[3], argv[4:]
    command = celery_cli.commands.get(sub)
    if command is None:
        return [f"{name}: celery has no subcommand {sub!r}"]
    from celery.bin.base import CLIContext

    if error := _click_problem(command, rest, obj=CLIContext(app=celery_app, no_color=True, workdir=None, quiet=True)):
        problems.append(f"{name}: celery {sub} refuses {rest}: {error}")
    if sub == "worker":
        queues = rest[rest.index("-Q") + 1].split(",") if "-Q" in rest else [celery_app.conf.task_default_queue]
        node = env.get("SLUICE_NODE_NAME")
        expected = node_queue(node) if node else celery_app.conf.task_default_queue
        if queues != [expected]:
            problems.append(f"{name}: celery worker consumes {queues}, the code queues its tasks on {expected!r}")
        if node and "--pool=solo" not in rest:
            problems.append(f"{name}: a node agent needs --pool=solo (its workers are children of the one process)")
    return problems


def environment_problems(compose: dict, read: set[str]) -> list[str]:
    problems = []
    for name, service in _sluice_services(compose).items():
        env = service.get("environment") or {}
        for variable in sorted(set(env) - read):
            problems.append(f"{name}: sets {variable}, which no code reads (a typo, or a setting that went away?)")
        argv = service.get("command") or []
        django = argv[:2] == ["python", "manage.py"] or "uvicorn" in argv or argv[:1] == ["celery"]
        if django and (missing := REQUIRED_DJANGO_ENV - set(env)):
            problems.append(f"{name}: a Django process without {sorted(missing)}")
        if env.get("SLUICE_NODE_NAME") and (missing := NODE_AGENT_ENV - set(env)):
            problems.append(f"{name}: a node agent without {sorted(missing)}")
    return problems


def dockerfile_problems(dockerfile: Path, read: set[str]) -> list[str]:
    problems = []
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            for source in words[1:-1]:
                if not (REPO / source).exists():
                    problems.append(f"{dockerfile.name}: COPY {source}: no such file in the repository")
        if words[:1] == ["ENV"]:
            for pair in words[1:]:
                variable = pair.split("=", 1)[0]
                if variable not in read | INTERPRETER_ENV:
                    problems.append(f"{dockerfile.name}: ENV {variable}, which no code reads")
    return problems


def documentation_problems(compose_path: Path, env_example: Path, readme: Path, compose: dict) -> list[str]:
    """docker/README.md names every variable; .env.example lists every one compose interpolates."""
    problems = []
    text = readme.read_text()
    variables = compose_variables(compose_path)
    for service in _sluice_services(compose).values():
        variables |= set(service.get("environment") or {})
    for variable in sorted(variables):
        if f"`{variable}`" not in text:
            problems.append(f"docker/README.md does not list `{variable}`")
    for variable in sorted(compose_variables(compose_path) - set(read_env_file(env_example))):
        problems.append(f"docker/.env.example lacks {variable}")
    return problems


def endpoint_problems(compose: dict) -> list[str]:
    """The gateways' SLUICE_WORKER_ENDPOINTS are what the workers advertise (a wildcard bind under
    --advertise-host, else the container's hostname, as workers.worker.server.connectable_endpoint
    writes it), and every --registry-endpoint / SLUICE_REGISTRY_ENDPOINT names the registry's bind."""
    advertised, registries, problems = set(), set(), []
    for service in _sluice_services(compose).values():
        argv = service.get("command") or []
        flags = dict(arg.split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
        host = flags.get("--advertise-host") or service.get("hostname", "")
        if "run_worker" in argv:
            pair = tuple(flags[f"--{kind}-endpoint"].replace("*", host) for kind in ("request", "heartbeat"))
            advertised.add("|".join(pair))
        if "run_registry" in argv:
            registries.add(flags["--endpoint"].replace("*", host))
    for name, service in _sluice_services(compose).items():
        env = service.get("environment") or {}
        flags = dict(arg.split("=", 1) for arg in service.get("command") or [] if arg.startswith("--") and "=" in arg)
        for pair in filter(None, env.get("SLUICE_WORKER_ENDPOINTS", "").split(",")):
            if pair not in advertised:
                problems.append(
                    f"{name}: SLUICE_WORKER_ENDPOINTS names {pair}, which no worker advertises {advertised}"
                )
        for registry in filter(None, [flags.get("--registry-endpoint"), env.get("SLUICE_REGISTRY_ENDPOINT")]):
            if registry not in registries:
                problems.append(f"{name}: registers at {registry}, but the registry binds {registries}")
    return problems


def _speaks_zmq_over_the_network(argv: list[str]) -> bool:
    """Workers, the registry, gateways and Celery workers (control commands; node agents' workers)."""
    return bool({"run_worker", "run_registry", "controlplane.asgi:application"} & set(argv)) or argv[:4] == [
        "celery",
        "-A",
        "controlplane",
        "worker",
    ]


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """Mount point → (volume, read-only) of the service's volumes."""
    mounts = {}
    for volume in service.get("volumes") or []:
        source, target, *mode = volume.split(":")
        mounts[target] = (source, mode == ["ro"])
    return mounts


def curve_key_problems(compose: dict) -> list[str]:
    """Every process that speaks ZMQ over the network is given the cluster's CURVE key file
    (SLUICE_CURVE_KEY_FILE, workers.curve), in a volume mounted read-only that one one-shot service
    writes with export_data_plane_key before they start."""
    services = _sluice_services(compose)
    writers = {}  # key file → (service, volume)
    for name, service in services.items():
        argv = service.get("command") or []
        if argv[:3] == ["python", "manage.py", "export_data_plane_key"]:
            directory = str(Path(argv[3]).parent)
            writers[argv[3]] = (name, _mounts(service).get(directory, ("", False))[0])
    problems = []
    for name, service in services.items():
        if not _speaks_zmq_over_the_network(service.get("command") or []):
            continue
        key_file = (service.get("environment") or {}).get("SLUICE_CURVE_KEY_FILE")
        if not key_file:
            problems.append(f"{name}: speaks ZMQ over the network without SLUICE_CURVE_KEY_FILE")
            continue
        if key_file not in writers:
            problems.append(f"{name}: SLUICE_CURVE_KEY_FILE {key_file} is written by no export_data_plane_key")
            continue
        writer, volume = writers[key_file]
        if _mounts(service).get(str(Path(key_file).parent)) != (volume, True):
            problems.append(f"{name}: does not mount {volume} read-only where {key_file} is")
        condition = (service.get("depends_on") or {}).get(writer, {}).get("condition")
        if condition != "service_completed_successfully":
            problems.append(f"{name}: may start before {writer} wrote {key_file}")
    return problems
