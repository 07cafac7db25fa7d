"""A node agent's process work: starts engine worker processes on this host, stops them, and notices
the ones that exit. No Django: the control plane's tasks (or the embedded supervisor) say what to start
and record what happened through the `on_exit` callback.

Every process started here dies with the agent (PR_SET_PDEATHSIG, set by the worker itself too) and is
reaped by `reap()`, which the owner calls periodically (or `start_reaper()` does on a thread).
"""

import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from workers import curve
from workers.client.control_client import ControlRejectedError, ControlTimeoutError, new_command_id, send_control
from workers.protocol.messages import ShutdownRequest
from workers.worker.args import WorkerArgs

log = logging.getLogger(__name__)

SHUTDOWN_ACK_TIMEOUT_S = 5.0
REAP_INTERVAL_S = 0.5
ENCODE_ROLE = "encode"


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What to start: the control plane's instance and the worker it stands for."""

    instance_id: int
    worker_id: str
    pool: str
    role: str  # "prefill", "decode", "mixed" or "encode" (a vision encoder)
    model: str
    # The pool's precision (EngineArgs.quantization, kv_cache_dtype): over the host's worker options.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class StartedWorker:
    pid: int
    request_endpoint: str
    heartbeat_endpoint: str


@dataclass
class _Held:
    launch: WorkerLaunch
    process: subprocess.Popen
    started: StartedWorker
    stop_requested: bool = False


# on_exit(instance_id, exit code, whether a stop asked for it)
ExitCallback = Callable[[int, int, bool], object]


class NodeAgent:
    def __init__(
        self,
        *,
        runtime_dir: Path,
        registry_endpoint: str,
        worker_options: Callable[[str], Sequence[str]],
        on_exit: ExitCallback,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        curve_key_file: str = "",
        advertise_host: str = "",
    ) -> None:
        """`worker_options(role)`: the engine and worker flags this host gives a worker of that role
        (device, KV cache size, KV store...), checked when a worker starts (ValueError); an encode
        worker (a vision encoder: request and heartbeat endpoints as a prefill worker's, no transfer
        endpoint) is started without the host's KV store, which it has no use for. The agent
        adds identity, pool, model, the pool's precision, endpoints, and `curve_key_file`, the agent's
        own copy of the cluster's CURVE key (workers.curve), which its workers need to register with a
        registry on the network. `advertise_host`: the name or address other hosts reach this one by; its
        workers then listen on tcp ports of every interface and register under that name, so
        gateways and prefill workers elsewhere reach them (which needs the key). Empty: ipc sockets
        in `runtime_dir`, reachable from this host only."""
        self.runtime_dir = runtime_dir
        self.registry_endpoint = registry_endpoint
        self.worker_options = worker_options
        self.on_exit = on_exit
        self.env = env
        self.cwd = cwd
        self.curve_key_file = curve_key_file
        self.advertise_host = advertise_host
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()

    def holds(self, instance_id: int) -> bool:
        with self._lock:
            return instance_id in self._held

    def held_instances(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def start(self, launch: WorkerLaunch) -> StartedWorker:
        """Starts the worker process; it registers itself with the registry under `launch.worker_id`."""
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if launch.instance_id in self._held:
                raise ValueError(f"instance {launch.instance_id} already has a process here")
        kinds = ("req", "hb", "kv") if launch.role == "decode" else ("req", "hb")
        if self.advertise_host:
            ports = [_free_tcp_port() for _ in kinds]
            binds = [f"tcp://*:{port}" for port in ports]
            reached = [f"tcp://{self.advertise_host}:{port}" for port in ports]
        else:
            binds = reached = [f"ipc://{self.runtime_dir}/{launch.worker_id}.{kind}" for kind in kinds]
        args = WorkerArgs.from_argv(
            self.worker_options(launch.role),
            model=launch.model,
            quantization=launch.quantization,
            kv_cache_dtype=launch.kv_cache_dtype,
            role=launch.role,
            pool=launch.pool,
            worker_id=launch.worker_id,
            request_endpoint=binds[0],
            heartbeat_endpoint=binds[1],
            registry_endpoint=self.registry_endpoint,
            **({"transfer_endpoint": binds[2]} if launch.role == "decode" else {}),
            **({"kv_store": None} if launch.role == ENCODE_ROLE else {}),
            **({"advertise_host": self.advertise_host} if self.advertise_host else {}),
            **({"curve_key_file": self.curve_key_file} if self.curve_key_file else {}),
        )
        process = subprocess.Popen(worker_command(args), env=self.env, cwd=self.cwd)
        started = StartedWorker(pid=process.pid, request_endpoint=reached[0], heartbeat_endpoint=reached[1])
        with self._lock:
            self._held[launch.instance_id] = _Held(launch, process, started)
        log.info("started worker %s (pid %d) for pool %s", launch.worker_id, process.pid, launch.pool)
        return started

    def stop(self, instance_id: int, *, grace_s: float) -> int | None:
        """Asks the worker to shut down (a ShutdownRequest), then SIGTERM after `grace_s`, then SIGKILL;
        returns its exit code, or None when no process of that instance is held here."""
        with self._lock:
            held = self._held.get(instance_id)
            if held is None:
                return None
            held.stop_requested = True
        if held.process.poll() is None:
            try:
                send_control(
                    held.started.request_endpoint,
                    ShutdownRequest(command_id=new_command_id()),
                    timeout_s=min(SHUTDOWN_ACK_TIMEOUT_S, grace_s),
                    key=curve.load_key_file(self.curve_key_file) if self.curve_key_file else None,
                )
            except (ControlTimeoutError, ControlRejectedError, curve.CurveError) as error:
                log.warning("worker %s did not take its shutdown (%s); terminating it", held.launch.worker_id, error)
        code = _wait_or_kill(held.process, grace_s)
        self._forget(instance_id, code)
        return code

    def reap(self) -> list[tuple[int, int]]:
        """Forgets the processes that exited, reporting each through on_exit; returns (instance, code)."""
        with self._lock:
            exited = [(i, h.process.poll()) for i, h in self._held.items() if h.process.poll() is not None]
        for instance_id, code in exited:
            self._forget(instance_id, code)
        return exited

    def stop_all(self, *, grace_s: float) -> None:
        for instance_id in self.held_instances():
            self.stop(instance_id, grace_s=grace_s)

    def start_reaper(self, stop: threading.Event, interval_s: float = REAP_INTERVAL_S) -> threading.Thread:
        def run() -> None:
            while not stop.wait(interval_s):
                try:
                    self.reap()
                except Exception:
                    log.exception("reaping worker processes failed")

        thread = threading.Thread(target=run, name="node-agent-reaper", daemon=True)
        thread.start()
        return thread

    def _forget(self, instance_id: int, code: int) -> None:
        with self._lock:
            held = self._held.pop(instance_id, None)
        if held is None:  # the reaper and a stop both saw it exit: reported once
            return
        if not held.stop_requested:
            log.error("worker %s (pid %d) exited with code %d", held.launch.worker_id, held.started.pid, code)
        self.on_exit(instance_id, code, held.stop_requested)


def worker_command(args: WorkerArgs) -> list[str]:
    """The command that starts a worker with `args`."""
    return [sys.executable, "-m", "workers.worker", *args.to_argv()]


def _free_tcp_port() -> int:
    """A tcp port no socket of this host holds now. The worker binds it a moment later; should
    another process take it first, the worker exits and its instance fails, to be started again."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _wait_or_kill(process: subprocess.Popen, grace_s: float) -> int:
    try:
        return process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
