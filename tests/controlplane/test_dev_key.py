"""The developer API key `serve` prints, on two real PostgreSQL databases taken from one checkout (one
var/ directory): each database keeps its own key file, so each printed key authenticates against its
own database, and a database reset since the key was printed gets a new one."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# In a process of its own on $DATABASE_URL: which of the keys given as arguments authenticate, then
# the dev key serve would print, and whether it authenticates.
PROBE = """
import json, sys
import django
django.setup()
from controlplane.dev_key import dev_api_key
from controlplane.tenants.services import api_key_authenticate
authenticates = [api_key_authenticate(raw_key=key) is not None for key in sys.argv[1:]]
key = dev_api_key()
valid = api_key_authenticate(raw_key=key) is not None
print(json.dumps({"authenticates": authenticates, "dev_key": key, "valid": valid}))
"""


@pytest.fixture(scope="module")
def two_databases() -> Iterator[tuple[str, str]]:
    """Two throw-away databases with the schema: the first migrated, the second a copy of it. Each
    test takes its keys into a var/ directory of its own, so the databases' other keys do not matter."""
    names = [f"sluice_dev_key_{os.getpid()}_{n}" for n in ("a", "b")]
    urls = tuple(f"postgres://postgres@127.0.0.1:5432/{name}" for name in names)
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        for name in names:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{names[0]}"')
        manage({"DATABASE_URL": urls[0]}, "migrate", "--no-input")
        connection.execute(f'CREATE DATABASE "{names[1]}" TEMPLATE "{names[0]}"')
    yield urls
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        for name in names:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args], env={**os.environ, **env}, cwd=ROOT, check=True, timeout=120
    )


def probe(env: dict[str, str], *keys: str) -> dict:
    completed = subprocess.run(
        [sys.executable, "-c", PROBE, *keys],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.splitlines()[-1])


def test_each_database_keeps_its_own_dev_key(tmp_path, two_databases):
    # given two stacks' settings: one var/ directory, two databases
    first, second = ({"DATABASE_URL": url, "SLUICE_VAR_DIR": str(tmp_path)} for url in two_databases)

    # when serve's dev key is taken on the first database, then on the second, then on the first again
    first_key = probe(first)["dev_key"]
    on_second = probe(second, first_key)
    second_key = on_second["dev_key"]
    on_first_again = probe(first, first_key, second_key)

    # then each printed key authenticates against its own database only, and the first's is kept
    assert on_second["authenticates"] == [False] and on_second["valid"]
    assert on_first_again["dev_key"] == first_key and on_first_again["valid"]
    assert on_first_again["authenticates"] == [True, False]
    files = sorted(tmp_path.glob("dev-api-key-*"))
    assert len(files) == 2 and {path.read_text().strip() for path in files} == {first_key, second_key}
    assert {path.stat().st_mode & 0o777 for path in files} == {0o600}


def test_a_reset_database_gets_a_new_dev_key(tmp_path, two_databases):
    # given a dev key printed for a database that is then reset
    env = {"DATABASE_URL": two_databases[0], "SLUICE_VAR_DIR": str(tmp_path)}
    old_key = probe(env)["dev_key"]
    manage(env, "flush", "--no-input")

    # when serve's dev key is taken again
    after_reset = probe(env, old_key)

    # then the old key is gone from the database and the file holds a new one that authenticates
    assert after_reset["authenticates"] == [False]
    assert after_reset["dev_key"] != old_key and after_reset["valid"]
    (path,) = tmp_path.glob("dev-api-key-*")
    assert path.read_text().strip() == after_reset["dev_key"]
