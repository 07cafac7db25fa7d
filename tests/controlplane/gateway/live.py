"""A live gateway for tests: a real worker process (SmolLM2, or another model such as the tiny VLM of
tests.vlm_model) on ipc:// sockets, and uvicorn serving the real ASGI application (lifespan included)
in a thread of the test process; `served_models` has the gateway serve other models than SmolLM2."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
import zmq
from django.test import override_settings

from controlplane.asgi import application
from tests.controlplane.gateway.helpers import SMOLLM2

REPO_ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 120.0


def _wait_for_heartbeat(endpoint: str, process: subprocess.Popen) -> None:
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while not subscriber.poll(200):
            if process.poll() is not None:
                raise RuntimeError(f"the worker exited with {process.returncode} before its first heartbeat")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no heartbeat from the worker in {STARTUP_TIMEOUT_S} s")
    finally:
        subscriber.close(linger=0)
        context.term()


@contextlib.contextmanager
def worker_process(directory: Path, model: str | os.PathLike = SMOLLM2) -> Iterator[tuple[str, str]]:
    """(request endpoint, heartbeat endpoint) of a running worker of `model` (a name or a directory)."""
    endpoints = (f"ipc://{directory}/w.req", f"ipc://{directory}/w.hb")
    command = [sys.executable, "-m", "workers.worker", "--model", os.fspath(model), "--worker-id", "gateway-tests"]
    command += ["--request-endpoint", endpoints[0], "--heartbeat-endpoint", endpoints[1]]
    command += ["--kv-cache-bytes", str(128 << 20)]
    # One torch thread: on a small shared machine more threads than cores stall the worker's steps
    # (and so its heartbeats) for seconds.
    process = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for_heartbeat(endpoints[1], process)
        yield endpoints
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def live_gateway(worker: tuple[str, str], django_db_blocker, listener: socket.socket | None = None) -> Iterator[str]:
    """The gateway's base URL, serving on `listener` (default: a fresh one on a free port)."""
    if listener is None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(application, lifespan="on", log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    with override_settings(SLUICE_WORKER_ENDPOINTS=[worker]):
        with django_db_blocker.unblock():  # the lifespan startup checks whether any key exists
            thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
            thread.start()
            while not server.started:
                assert thread.is_alive(), "the gateway did not start (see its log above)"
                time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=15)
            listener.close()


@contextlib.contextmanager
def served_models(*models: str | os.PathLike) -> Iterator[None]:
    """The gateway serves `models` (SLUICE_MODELS) meanwhile: its catalog and prepare processes are
    made afresh for them, and again for the settings before once it is over."""
    from controlplane.gateway import catalog, preparation

    preparation.close_preparation()
    before = catalog._catalog
    catalog._catalog = None
    try:
        with override_settings(SLUICE_MODELS=[os.fspath(model) for model in models]):
            yield
    finally:
        preparation.close_preparation()
        catalog._catalog = before
