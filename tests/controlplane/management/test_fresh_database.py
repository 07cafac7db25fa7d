"""A database that was never migrated, through real `manage.py` processes on a fresh SQLite file:
`serve` (the embedded default) migrates it before it starts anything and says so in one line;
commands that need the tables say in one line to run migrate and exit 1, without a traceback. Once
stopped, `serve` leaves no runtime directory (its ipc sockets) behind."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NOT_MIGRATED = re.compile(
    r"CommandError: the database is not set up \(\d+ migrations not applied\): run `python manage.py migrate` first"
)


def fresh_env(tmp_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        DATABASE_URL=f"sqlite:///{tmp_path / 'fresh.sqlite3'}",
        SLUICE_VAR_DIR=str(tmp_path),
        PYTHONUNBUFFERED="1",
    )


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "command",
    [
        ("create_api_key", "--tenant", "acme"),
        ("ensure_topology", "--node", "node-a", "--model", "m", "--pool", "prefill=1"),
    ],
)
def test_a_command_that_needs_tables_says_to_migrate_and_exits_1(tmp_path, command):
    # given a database file that was never migrated
    env = fresh_env(tmp_path)

    # when
    completed = manage(env, *command)

    # then
    assert completed.returncode == 1
    assert NOT_MIGRATED.fullmatch(completed.stderr.strip()), completed.stderr
    assert completed.stdout == ""


def test_serve_migrates_a_fresh_database_before_it_starts_anything_and_cleans_up_after_itself(tmp_path):
    # given a database file that was never migrated (and a temp directory to find serve's runtime one in)
    env = dict(fresh_env(tmp_path), TMPDIR=str(tmp_path))

    # when serve starts (as far as its banner's dev key: everything it does before its children run),
    # then is stopped with Ctrl-C, its supervisor running or not yet
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "serve", "--workers=1", "--no-kv-store", "--port=0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if line.lstrip().startswith("dev key"):
                break
    finally:
        process.send_signal(signal.SIGINT)
        try:
            # Its supervisor gives each of three stop stages 10 s before it kills; children still
            # starting on a loaded machine take them (60 s ran out twice in a full local run).
            process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    # then it said it migrated, in one line before anything else, the tables are there, and its runtime
    # directory is gone
    printed = [line for line in lines if line]
    assert re.fullmatch(r"Applying \d+ database migrations \(python manage.py migrate\)", printed[0]), lines
    assert printed[1].startswith("sluice is starting"), lines
    (key_file,) = tmp_path.glob("dev-api-key-*")
    assert printed[-1].split() == ["dev", "key", key_file.read_text().strip()], lines
    assert list(tmp_path.glob("sluice-*")) == []
    created = manage(env, "create_api_key", "--tenant", "acme")
    assert created.returncode == 0, created.stderr
