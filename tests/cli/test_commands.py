"""`sluice`'s commands as processes, from the checkout's code: what it lists, where its state goes,
and bad input as one line and exit code 2, before anything starts."""

import importlib.metadata
import re
import socket

import pytest

from tests.cli.running import sluice_from_checkout
from tests.e2e.conftest import free_port


def test_help_lists_every_command(user):
    # when the user asks for help
    completed = sluice_from_checkout(*user, "--help")

    # then every command is listed, with the global data directory
    assert completed.returncode == 0, completed.stderr
    for command in ("serve", "api-key", "bench", "migrate", "version", "--data-dir"):
        assert command in completed.stdout


def test_version_names_sluice_and_torch(user):
    completed = sluice_from_checkout(*user, "version")

    assert completed.returncode == 0, completed.stderr
    expected = f"sluice {importlib.metadata.version('sluice')} (torch {importlib.metadata.version('torch')})"
    assert completed.stdout.strip() == expected


def test_state_goes_to_the_data_directory_never_to_the_working_directory(user, tmp_path):
    # given a data directory named by SLUICE_DATA_DIR
    home, cwd = user
    data = tmp_path / "data"

    # when the database is migrated and a key created there
    migrated = sluice_from_checkout(home, cwd, "migrate", SLUICE_DATA_DIR=str(data))
    created = sluice_from_checkout(home, cwd, "--data-dir", str(data), "api-key", "create", "--tenant", "acme")

    # then the SQLite database is in the data directory, the key is the last line, and the working
    # directory and the default data directory stay empty
    assert migrated.returncode == 0, migrated.stderr
    assert created.returncode == 0, created.stderr
    assert (data / "sluice.sqlite3").is_file()
    assert re.fullmatch(r"\S{20,}", created.stdout.strip().splitlines()[-1])
    assert list(cwd.iterdir()) == []
    assert not (home / ".local").exists()


def unreachable_database() -> dict[str, str]:
    return {"DATABASE_URL": f"postgres://postgres@127.0.0.1:{free_port()}/sluice"}


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (("serve", "no-such-model", "--port=0"), {}, "sluice: unknown model 'no-such-model'"),
        (("migrate",), unreachable_database(), "sluice: cannot connect to the database (DATABASE_URL)"),
        (("serve", "--port=0"), unreachable_database(), "sluice: cannot connect to the database (DATABASE_URL)"),
        (("migrate",), {"DATABASE_URL": "mysql://db/sluice"}, "sluice: DATABASE_URL scheme 'mysql' is not supported"),
    ],
    ids=["unknown-model", "unreachable-database-migrate", "unreachable-database-serve", "unsupported-database"],
)
def test_bad_input_is_one_line_and_exit_code_2(user, args, env, says):
    completed = sluice_from_checkout(*user, *args, **env)

    assert_bad_input(completed, says)


def test_a_port_in_use_is_one_line_and_exit_code_2(user):
    # given a port something listens on
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]

        # when serve is asked to listen there
        completed = sluice_from_checkout(*user, "serve", f"--port={port}")

    # then it says so, before it starts anything
    assert_bad_input(completed, f"sluice: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "sluice is starting" not in completed.stdout


def test_a_bad_option_of_serve_is_argparses_error(user):
    completed = sluice_from_checkout(*user, "serve", "--no-such-option")

    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert completed.stderr.strip().splitlines()[-1] == "sluice serve: error: unrecognized arguments: --no-such-option"


def assert_bad_input(completed, says: str) -> None:
    assert completed.returncode == 2, (completed.stdout, completed.stderr)
    assert "Traceback" not in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert completed.stderr.startswith(says), completed.stderr
