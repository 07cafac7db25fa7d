"""Real worker processes for tests: a tiny random-weight model behind ipc:// endpoints, and plain
synchronous sockets to talk to them directly."""

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.client.engine_client import EngineClient
from workers.protocol.messages import GenerateOutput, GenerateRequest, WorkerHeartbeat, WorkerInbound, WorkerOutbound

REPO_ROOT = Path(__file__).resolve().parents[2]
# A long window so that a stream can run for seconds: long enough to abort, cancel or kill it mid-way.
CONFIG = {**TINY_CONFIGS["llama"], "max_position_embeddings": 4096}
LONG = 4000  # max_tokens of a stream meant to be cut short
SEED = 0
KV_CACHE_BYTES = 1 << 24
STARTUP_TIMEOUT_S = 60.0


def endpoints(directory: Path, name: str) -> tuple[str, str]:
    """(request, heartbeat) ipc endpoints; ipc paths stay short in a tmp_path_factory directory."""
    return f"ipc://{directory}/{name}.req", f"ipc://{directory}/{name}.hb"


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    endpoints: tuple[str, str]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def worker_command(
    directory: Path,
    name: str,
    *options: str,
    config: dict = CONFIG,
    model: str | None = None,
    module: str = "workers.worker",
) -> list[str]:
    """Runs a worker of a tiny model as `name` (also its worker id) on `endpoints(directory, name)`.
    The model is named after its config file: `model` (default: `name`); workers that hand KV to
    each other must serve the same model name. `module` is the entry point run with `-m`."""
    config_path = directory / f"{model or name}.json"
    config_path.write_text(json.dumps(config))
    request_endpoint, heartbeat_endpoint = endpoints(directory, name)
    return [
        sys.executable,
        "-m",
        module,
        "--model",
        str(config_path),
        "--request-endpoint",
        request_endpoint,
        "--heartbeat-endpoint",
        heartbeat_endpoint,
        "--seed",
        str(SEED),
        "--kv-cache-bytes",
        str(KV_CACHE_BYTES),
        "--worker-id",
        name,
        *options,
    ]


def transfer_endpoint(directory: Path, name: str) -> str:
    return f"ipc://{directory}/{name}.kv"


def role_options(directory: Path, name: str, role: str) -> list[str]:
    """The options that make worker `name` a mixed, prefill or decode worker."""
    options = ["--role", role]
    return [*options, "--transfer-endpoint", transfer_endpoint(directory, name)] if role == "decode" else options


def start_worker(
    directory: Path,
    name: str,
    *options: str,
    config: dict = CONFIG,
    model: str | None = None,
    module: str = "workers.worker",
) -> WorkerProcess:
    command = worker_command(directory, name, *options, config=config, model=model, module=module)
    return WorkerProcess(subprocess.Popen(command, cwd=REPO_ROOT), endpoints(directory, name))


async def connected_client(*workers: tuple[str, str], heartbeat_timeout_s: float = 3.0, **options) -> EngineClient:
    """A started client that has heard from every worker, given as (request, heartbeat) endpoints;
    `options` go to the EngineClient."""
    client = EngineClient(heartbeat_timeout_s=heartbeat_timeout_s, **options)
    for request_endpoint, heartbeat_endpoint in workers:
        client.add_worker(request_endpoint, heartbeat_endpoint)
    await client.start()
    await wait_for_heartbeat(client, lambda beats: len(beats) == len(workers), timeout_s=STARTUP_TIMEOUT_S)
    return client


async def wait_for_heartbeat(client: EngineClient, condition, timeout_s: float = 10.0) -> list[WorkerHeartbeat]:
    """The healthy workers' latest heartbeats, once `condition` holds for them."""
    deadline = time.monotonic() + timeout_s
    while not condition(beats := client.healthy_workers()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"heartbeats never satisfied the condition; last: {beats}")
        await asyncio.sleep(0.02)
    return beats


async def collect(client: EngineClient, request: GenerateRequest) -> list[GenerateOutput]:
    return [output async for output in client.generate(request)]


def heartbeat_of(client: EngineClient, worker_id: str) -> WorkerHeartbeat:
    """The client's latest heartbeat from a healthy worker."""
    return next(beat for beat in client.healthy_workers() if beat.worker_id == worker_id)


async def stream_into(client: EngineClient, request: GenerateRequest, tokens: list[int]) -> str:
    """Stream `request`, appending its tokens as they come; its finish reason."""
    async for output in client.generate(request):
        tokens.extend(output.token_ids)
        if output.finish_reason is not None:
            return output.finish_reason
    return ""


async def all_have(tokens: dict[str, list[int]], count: int) -> None:
    """Wait until every stream has `count` tokens."""
    while min(len(t) for t in tokens.values()) < count:
        await asyncio.sleep(0.01)


def token_ids(outputs: list[GenerateOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


class Dealer:
    """A synchronous DEALER to one worker: messages in order, replies decoded (for tests that need
    the worker to see several messages in a known order)."""

    def __init__(self, request_endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(request_endpoint)

    def send(self, *messages: WorkerInbound) -> None:
        for message in messages:
            self.socket.send(msgspec.msgpack.encode(message))

    def receive(self, timeout_s: float = 30.0) -> WorkerOutbound:
        if not self.socket.poll(timeout_s * 1000):
            raise TimeoutError(f"no reply in {timeout_s} s")
        return msgspec.msgpack.decode(self.socket.recv(), type=WorkerOutbound)

    def close(self) -> None:
        self.socket.close()
        self.context.term()

    def __enter__(self) -> "Dealer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def wait_for_worker_heartbeat(
    heartbeat_endpoint: str, condition: Callable[[WorkerHeartbeat], bool] = lambda _: True, timeout_s: float = 60.0
) -> WorkerHeartbeat:
    """The first heartbeat from `heartbeat_endpoint` that satisfies `condition` (synchronous)."""
    deadline = time.monotonic() + timeout_s
    with zmq.Context() as context, context.socket(zmq.SUB) as subscriber:
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(heartbeat_endpoint)
        last = None
        while (left := deadline - time.monotonic()) > 0:
            if subscriber.poll(left * 1000):
                last = msgspec.msgpack.decode(subscriber.recv(), type=WorkerHeartbeat)
                if condition(last):
                    return last
        raise TimeoutError(f"no heartbeat satisfied the condition; last: {last}")
