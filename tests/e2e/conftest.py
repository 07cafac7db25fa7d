"""The real stack (`manage.py serve`: gateway + one worker with the real SmolLM2) on PostgreSQL, once
per session, called through the official SDKs."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass(frozen=True)
class Stack:
    base_url: str
    api_key: str
    env: dict[str, str]

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, **kwargs)

    def anthropic(self, **kwargs) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manage(env: dict[str, str], *args: str) -> str:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args], env=env, capture_output=True, text=True, check=True
    )
    return completed.stdout


def wait_until_ready(base_url: str, process: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with code {process.returncode}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the stack did not become healthy")


def start_stack(tmp: Path, database_url: str, tenant: str, *serve_args: str) -> tuple[subprocess.Popen, Stack]:
    """`serve_args` go to `manage.py serve` (e.g. "--workers=1"; default: one prefill and one decode worker)."""
    env = dict(os.environ, DATABASE_URL=database_url, SLUICE_VAR_DIR=str(tmp), PYTHONUNBUFFERED="1")
    manage(env, "migrate", "--no-input")
    api_key = manage(env, "create_api_key", "--tenant", tenant).strip().splitlines()[-1]
    port = free_port()
    log = open(tmp / "serve.log", "w")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "serve", f"--port={port}", f"--model={MODEL}", *serve_args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    wait_until_ready(base_url, process)
    return process, Stack(base_url=base_url, api_key=api_key, env=env)


def stop_stack(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[str]:
    name = f"sluice_e2e_{os.getpid()}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        connection.execute(f'CREATE DATABASE "{name}"')
    yield f"postgres://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres_database: str) -> Iterator[Stack]:
    process, running = start_stack(tmp_path_factory.mktemp("stack"), postgres_database, "e2e")
    yield running
    stop_stack(process)
