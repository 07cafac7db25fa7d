"""`sluice`: the console script `pip install` brings. Each command runs without a checkout: settings
come from environment variables, and state (the SQLite database, the KV store, the node runtime...)
goes to the data directory (--data-dir, else $SLUICE_DATA_DIR, else ~/.local/share/sluice), never to
the current directory. Bad input (an unknown model, a port in use, an unreachable database) is one
line on stderr and exit code 2, before anything starts."""

import argparse
import os
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from controlplane.cli.bad_input import BadInput
from controlplane.manage import main as manage

# Django, torch and the benchmark are imported by the commands that use them, so `sluice --help` and
# `sluice version` answer at once.

BAD_INPUT_EXIT_CODE = 2


def default_data_dir() -> Path:
    configured = os.environ.get("SLUICE_DATA_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "sluice"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Disaggregated LLM serving with a Django control plane."
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="where sluice keeps its state: the SQLite database, the KV store, the node runtime "
        "(default: $SLUICE_DATA_DIR, else ~/.local/share/sluice)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # serve's and the benchmark's own parsers read their options (and answer --help).
    _command(
        commands,
        "serve",
        _serve,
        "the gateway and engine workers on this machine (serve [MODEL] --help)",
        passes_on=True,
    )
    api_key = commands.add_parser("api-key", help="API keys")
    api_key_commands = api_key.add_subparsers(dest="api_key_command", required=True, metavar="COMMAND")
    create = _command(api_key_commands, "create", _api_key_create, "create a key for a tenant (created if needed)")
    create.add_argument("--tenant", required=True, help="tenant name")
    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    _command(bench_commands, "serve", _bench_serve, "the serving benchmark client (bench serve --help)", passes_on=True)
    _command(commands, "migrate", _migrate, "create or update the database's tables")
    _command(commands, "version", _version, "sluice's and torch's versions")
    return parser


def _command(commands, name: str, run: Callable, help: str, *, passes_on: bool = False) -> argparse.ArgumentParser:
    """A command that `passes_on` hands every argument after its name to the parser of what it runs."""
    command = commands.add_parser(name, help=help, add_help=not passes_on)
    command.set_defaults(run=run, passes_on=passes_on)
    return command


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, passed_on = parser.parse_known_args(argv)
    if passed_on and not args.passes_on:
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    # The settings (controlplane.settings) keep their state under SLUICE_VAR_DIR; children inherit it.
    os.environ["SLUICE_VAR_DIR"] = str((args.data_dir or default_data_dir()).expanduser().resolve())
    try:
        args.run(args, passed_on)
    except BadInput as error:
        print(f"sluice: {error}", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT_CODE)


def _setup_django() -> None:
    """Django's settings and apps; a bad setting (an unsupported DATABASE_URL...) is bad input."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    from django.core.exceptions import ImproperlyConfigured

    from controlplane.database_url import DatabaseUrlError

    try:
        django.setup()
    except (ImproperlyConfigured, DatabaseUrlError) as error:
        raise BadInput(str(error)) from None


def _serve(args: argparse.Namespace, serve_argv: list[str]) -> None:
    _setup_django()
    from controlplane.cli.preflight import check_database, check_model, check_port_free
    from controlplane.cli.serve_command import ServeCommand

    command = ServeCommand()
    options = command.parse_options(serve_argv)
    check_database()
    check_port_free(options.host, options.port)
    check_model(options.model)
    command.run_from_argv(["sluice", "serve", *serve_argv])


def _api_key_create(args: argparse.Namespace, _: list[str]) -> None:
    _setup_django()
    from controlplane.cli.preflight import check_database

    check_database()
    manage(["sluice", "create_api_key", "--tenant", args.tenant])


def _migrate(args: argparse.Namespace, _: list[str]) -> None:
    _setup_django()
    from controlplane.cli.preflight import check_database

    check_database()
    manage(["sluice", "migrate", "--no-input"])


def _bench_serve(args: argparse.Namespace, bench_argv: list[str]) -> None:
    from bench.serve.cli import main as bench_serve

    bench_serve(bench_argv)


def _version(args: argparse.Namespace, _: list[str]) -> None:
    print(f"sluice {version('sluice')} (torch {version('torch')})")
