"""An engine worker process: serves GenerateRequests over ZMQ and publishes heartbeats.

Sockets: a ROUTER (requests and control commands in; each request's outputs and each command's
ControlAck go back to the peer that sent it) and a PUB (heartbeats, sent by their own thread). While
the engine has work, the loop checks the ROUTER without blocking between steps; when idle it blocks
on it for up to a heartbeat interval. With a registry endpoint, a thread announces the worker there.

Run it with `run_worker_process(WorkerConfig(...))` or `python -m workers.worker --model ...`.
"""

import argparse
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from workers.engine.config import EngineConfig
from workers.engine.constraints import TokenConstraint
from workers.engine.engine import LLMEngine
from workers.engine.errors import EngineOverloadedError, InvalidRequestError
from workers.engine.llm import DTYPES
from workers.engine.model_loader import load_model
from workers.engine.outputs import RequestDelta
from workers.engine.sampling_params import invalid_request_from
from workers.kvstore.eviction import POLICIES, get_policy
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.store import KVStore, open_store
from workers.kvstore.ttl import TTLPolicy
from workers.protocol import (
    AbortRequest,
    ApplyEPLayoutRequest,
    ControlRequest,
    DrainRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    ResumeRequest,
    SetTTLPolicyRequest,
    ShutdownRequest,
    StatusRequest,
    WorkerHeartbeat,
    WorkerInbound,
    WorkerOutbound,
    WorkerRegistration,
)
from workers.registry import register_until_acknowledged
from workers.worker_control import WorkerControl

log = logging.getLogger(__name__)

PROCESS_TITLE = "sluice-worker"  # /proc/self/comm keeps 15 bytes
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Inbound messages handled between two engine steps, so a flood of requests cannot stall decoding.
MAX_MESSAGES_PER_STEP = 256
CLOSE_LINGER_MS = 500  # time to flush the final outputs of aborted requests at shutdown


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str  # a packaged model name, a Hugging Face directory, or a config JSON (random weights)
    request_endpoint: str  # bound by the ROUTER, e.g. "tcp://*:7100" or "ipc:///run/sluice/w0.req"
    heartbeat_endpoint: str  # bound by the PUB
    worker_id: str = ""  # "" = "<hostname>-<pid>"
    role: str = "mixed"
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on CUDA
    tokenizer: str | None = None  # a model name or directory to take the tokenizer from
    seed: int = 0
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_waiting: int | None = None  # requests past this many waiting are answered "overloaded"
    heartbeat_interval_s: float = 0.1
    kv_store: str | None = None  # directory of the global KV block store; None: no store
    kv_store_index: str = "memory"  # "memory" (this process only) or "redis://host:port/db"
    kv_block_tokens: int = 128
    # The GC of the store, run by this worker every kv_gc_interval_s (0: another process runs it).
    kv_gc_interval_s: float = 10.0
    kv_store_capacity_bytes: int = 8 << 30
    kv_eviction_policy: str = "best"
    pool: str = ""  # the pool the control plane scales this worker in
    registry_endpoint: str | None = None  # where to register (a RegistryServer); None: nowhere
    ep_size: int = 1  # expert-parallel ranks: the shape an ApplyEPLayoutRequest must have

    def __post_init__(self) -> None:
        if self.role != "mixed":
            raise ValueError(f"only the 'mixed' worker role exists so far, got {self.role!r}")
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be at least 1, got {self.ep_size}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be positive, got {self.heartbeat_interval_s}")
        if self.kv_gc_interval_s < 0:
            raise ValueError(f"kv_gc_interval_s must be >= 0, got {self.kv_gc_interval_s}")
        if self.kv_eviction_policy not in POLICIES:
            raise ValueError(f"unknown kv_eviction_policy {self.kv_eviction_policy!r}; choose from {sorted(POLICIES)}")


def run_worker_process(config: WorkerConfig) -> None:
    """The worker's entry point: returns after SIGTERM/SIGINT or a ShutdownRequest; a crash is logged
    and exits 1."""
    _set_process_title(PROCESS_TITLE)
    _die_with_parent()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        store = open_store(Path(config.kv_store), config.kv_store_index) if config.kv_store else None
        engine = _build_engine(config, store)
        collector = _start_store_gc(store, config, stop) if store is not None and config.kv_gc_interval_s else None
        context = zmq.Context()
        try:
            Worker(config, engine, context, stop, collector).serve()
        finally:
            context.destroy(linger=CLOSE_LINGER_MS)
            engine.close()
    except Exception:
        log.exception("worker %s crashed", config.worker_id or os.getpid())
        raise SystemExit(1) from None


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        engine: LLMEngine,
        context: zmq.Context,
        stop: threading.Event,
        collector: GarbageCollector | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.stop = stop
        self.hostname = socket.gethostname()
        self.worker_id = config.worker_id or f"{self.hostname}-{os.getpid()}"
        self.started_at = time.time()
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(config.request_endpoint)
        self.publisher = context.socket(zmq.PUB)
        self.publisher.bind(config.heartbeat_endpoint)
        self.request_endpoint = connectable_endpoint(self.router, self.hostname)
        self.heartbeat_endpoint = connectable_endpoint(self.publisher, self.hostname)
        # Heartbeats come from their own thread: one engine step (a long prefill on a CPU) can take
        # seconds, longer than a client waits before it declares the worker dead. The PUB socket is
        # used by that thread alone (ZMQ sockets are not thread-safe).
        self.heartbeat_thread = threading.Thread(target=self._publish_heartbeats, name="heartbeats", daemon=True)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder(WorkerInbound)
        self.encoder = msgspec.msgpack.Encoder()
        self.owners: dict[str, bytes] = {}  # request id → ROUTER identity of the peer that sent it
        self.control = WorkerControl(
            self.worker_id, ep_size=config.ep_size, collector=collector, num_in_flight=lambda: len(self.owners)
        )
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            GenerateRequest: self._on_generate,
            AbortRequest: self._on_abort,
            DrainRequest: self._on_control,
            ResumeRequest: self._on_control,
            ShutdownRequest: self._on_shutdown,
            SetTTLPolicyRequest: self._on_control,
            ApplyEPLayoutRequest: self._on_control,
            StatusRequest: self._on_control,
        }
        self.registration_thread = (
            threading.Thread(
                target=register_until_acknowledged,
                args=(context, config.registry_endpoint, self._registration(), stop),
                name="registration",
                daemon=True,
            )
            if config.registry_endpoint
            else None
        )

    def serve(self) -> None:
        log.info(
            "worker %s serving %s on %s (heartbeats on %s)",
            self.worker_id,
            self.engine.model_name,
            self.config.request_endpoint,
            self.config.heartbeat_endpoint,
        )
        self.heartbeat_thread.start()
        if self.registration_thread is not None:
            self.registration_thread.start()
        while not self.stop.is_set():
            idle_ms = 0 if self.engine.has_unfinished() else self.config.heartbeat_interval_s * 1000
            if self.poller.poll(idle_ms):
                self._receive()
            if self.engine.has_unfinished():
                for delta in self.engine.step():
                    self._send_delta(delta)
                self.control.check_drained()
        self._shut_down()

    def _receive(self) -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames[0], frames[1:])

    def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._reject_malformed(peer, f"expected one message frame, got {len(frames)}", b"")
            return
        try:
            message = self.decoder.decode(frames[0])
        except msgspec.DecodeError as error:
            self._reject_malformed(peer, str(invalid_request_from(error)), frames[0])
            return
        try:
            self.handlers[type(message)](peer, message)
        except Exception:
            # A bug in admitting one request must not take the others down with the process.
            log.exception("handling %s failed", type(message).__name__)
            message_id = getattr(message, "request_id", None) or getattr(message, "command_id", "")
            self._send(peer, GenerateError(message_id, "internal", "the worker failed to handle the message"))

    def _on_generate(self, peer: bytes, request: GenerateRequest) -> None:
        if not self.control.accepting:
            message = f"worker {self.worker_id} is {self.control.state} and takes no new requests"
            self._send(peer, GenerateError(request.request_id, "draining", message))
            return
        try:
            constraint = self._compile_constraint(request) if request.constraint is not None else None
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                cache_namespace=request.cache_namespace,
                constraint=constraint,
                prompt_logprobs=request.prompt_logprobs,
                traffic_class=request.traffic_class,
            )
        except InvalidRequestError as error:
            self._send(peer, GenerateError(request.request_id, "invalid_request", str(error)))
        except EngineOverloadedError as error:
            self._send(peer, GenerateError(request.request_id, "overloaded", str(error)))
        else:
            self.owners[request.request_id] = peer

    def _compile_constraint(self, request: GenerateRequest) -> TokenConstraint:
        # Imported here: grammar compilation is recipe's job and only constrained requests need it.
        from recipe.constraints import compile_constraint

        if self.engine.tokenizer is None:
            raise InvalidRequestError("output constraints need a tokenizer; this model was loaded without one")
        return compile_constraint(request.constraint, self.engine.tokenizer, self.engine.model_config.vocab_size)

    def _on_abort(self, peer: bytes, request: AbortRequest) -> None:
        self._abort(request.request_id)
        self.control.check_drained()

    def _on_control(self, peer: bytes, request: ControlRequest) -> None:
        self._send(peer, self.control.handle(request))

    def _on_shutdown(self, peer: bytes, request: ShutdownRequest) -> None:
        """Abort what is in flight before acknowledging, so the ack confirms nothing is left running."""
        for request_id in list(self.owners):
            self._abort(request_id)
        self._on_control(peer, request)
        log.info("worker %s shutting down (command %s)", self.worker_id, request.command_id)
        self.stop.set()

    def _abort(self, request_id: str) -> None:
        """Stop a request; its owner gets a last output with finish_reason "abort"."""
        delta = self.engine.abort_request(request_id)
        if delta is not None:
            self._send_delta(delta)

    def _send_delta(self, delta: RequestDelta) -> None:
        owner = self.owners.pop(delta.request_id) if delta.finished else self.owners[delta.request_id]
        output = GenerateOutput(
            request_id=delta.request_id,
            token_ids=delta.token_ids,
            text=delta.text or "",
            logprobs=delta.logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=delta.prompt_logprobs,
        )
        self._send(owner, output)

    def _reject_malformed(self, peer: bytes, reason: str, payload: bytes) -> None:
        log.warning("malformed message from peer %s: %s", peer.hex(), reason)
        self._send(peer, GenerateError(self._readable_request_id(payload), "invalid_request", reason))

    def _readable_request_id(self, payload: bytes) -> str:
        """The request id of an undecodable message when its envelope is still readable, so that the
        sender's stream for it ends; "" when unknown, or when it names a request in flight."""
        try:
            fields = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            return ""
        request_id = fields.get("request_id") if isinstance(fields, dict) else None
        return request_id if isinstance(request_id, str) and request_id not in self.owners else ""

    def _send(self, peer: bytes, message: WorkerOutbound) -> None:
        # A ROUTER drops messages to peers that are gone rather than blocking.
        self.router.send_multipart([peer, self.encoder.encode(message)])

    def _publish_heartbeats(self) -> None:
        while not self.stop.wait(self.config.heartbeat_interval_s):
            self._publish_heartbeat()

    def _publish_heartbeat(self) -> None:
        # Read while the main thread steps: a racy snapshot of counters, good enough for load reports.
        stats = self.engine.stats()
        store = stats.store
        heartbeat = WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.config.role,
            model=self.engine.model_name,
            request_endpoint=self.request_endpoint,
            max_model_len=self.engine.max_model_len,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            num_free_pages=stats.num_free_pages,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_cached_prompt_tokens=stats.num_cached_prompt_tokens,
            num_preemptions=stats.num_preemptions,
            sent_at=time.time(),
            started_at=self.started_at,
            num_store_hit_tokens=store.num_hit_tokens if store else 0,
            num_store_blocks_read=store.num_blocks_read if store else 0,
            num_store_blocks_written=store.num_blocks_written if store else 0,
            state=self.control.state,
            pool=self.config.pool,
            ttl_policy_version=self.control.ttl_policy_version,
            ep_layout_version=self.control.ep_layout_version,
            heartbeat_endpoint=self.heartbeat_endpoint,
            hostname=self.hostname,
        )
        self.publisher.send(self.encoder.encode(heartbeat))

    def _registration(self) -> WorkerRegistration:
        device = torch.device(self.config.device)
        on_cuda = device.type == "cuda"
        return WorkerRegistration(
            worker_id=self.worker_id,
            pool=self.config.pool,
            role=self.config.role,
            model=self.engine.model_name,
            hostname=self.hostname,
            request_endpoint=self.request_endpoint,
            heartbeat_endpoint=self.heartbeat_endpoint,
            ep_size=self.config.ep_size,
            num_accelerators=1 if on_cuda else 0,
            accelerator_kind=torch.cuda.get_device_name(device) if on_cuda else device.type,
            started_at=self.started_at,
        )

    def _shut_down(self) -> None:
        """Abort what is in flight, so that every stream ends with an output rather than a timeout."""
        log.info("worker %s stopping; aborting %d requests", self.worker_id, len(self.owners))
        for request_id in list(self.owners):
            self._abort(request_id)
        self.router.close(linger=CLOSE_LINGER_MS)
        self.heartbeat_thread.join()
        if self.registration_thread is not None:
            self.registration_thread.join()
        self.publisher.close(linger=0)


def connectable_endpoint(bound: zmq.Socket, hostname: str) -> str:
    """The endpoint a socket is bound to, as a peer on another host connects to it: a wildcard TCP
    address names this host instead, and port 0 the port the system chose."""
    endpoint = bound.getsockopt_string(zmq.LAST_ENDPOINT)
    scheme, _, address = endpoint.partition("://")
    host, _, port = address.rpartition(":")
    if scheme == "tcp" and host in ("0.0.0.0", "[::]", "*"):
        return f"tcp://{hostname}:{port}"
    return endpoint


def _start_store_gc(store: KVStore, config: WorkerConfig, stop: threading.Event) -> GarbageCollector:
    collector = GarbageCollector(
        store.index,
        TTLPolicy(),
        get_policy(config.kv_eviction_policy),
        capacity_bytes=config.kv_store_capacity_bytes,
        delete_data=store.files.delete,
    )
    thread = threading.Thread(
        target=collector.run_forever, args=(stop, config.kv_gc_interval_s), name="kvstore-gc", daemon=True
    )
    thread.start()
    return collector


def _build_engine(config: WorkerConfig, store: KVStore | None) -> LLMEngine:
    dtype = DTYPES[config.dtype] if config.dtype else None
    loaded = load_model(
        config.model,
        device=torch.device(config.device),
        dtype=dtype,
        seed=config.seed,
        max_model_len=config.max_model_len,
        tokenizer=config.tokenizer,
    )
    engine_config = EngineConfig(
        device=config.device,
        dtype=dtype,
        kv_cache_bytes=config.kv_cache_bytes,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_block_tokens=config.kv_block_tokens,
        seed=config.seed,
        max_waiting=config.max_waiting,
    )
    return LLMEngine(loaded, engine_config, store)


def _set_process_title(title: str) -> None:
    """Best effort: the name ps/top show; only Linux exposes it as a file."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(title[:15])
    except OSError:
        pass


def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the parent exits, so a dead supervisor leaves no orphans."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    elif os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's command-line options, shared by this module's CLI and `manage.py run_worker`."""
    parser.add_argument("--role", default="mixed", choices=["mixed"], help="prefill and decode in one process")
    parser.add_argument("--model", required=True, help="packaged model name, HF directory or config JSON")
    parser.add_argument("--request-endpoint", required=True)
    parser.add_argument("--heartbeat-endpoint", required=True)
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-waiting", type=int)
    parser.add_argument("--heartbeat-interval", type=float, default=0.1, help="seconds")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--kv-store", help="directory of the global KV block store (default: no store)")
    parser.add_argument("--kv-store-index", default="memory", help='"memory" or redis://host:port/db')
    parser.add_argument("--kv-block-tokens", type=int, default=128)
    parser.add_argument("--kv-gc-interval", type=float, default=10.0, help="seconds; 0: no GC in this worker")
    parser.add_argument("--kv-store-capacity-bytes", type=int, default=8 << 30)
    parser.add_argument("--kv-eviction-policy", default="best", choices=sorted(POLICIES))
    parser.add_argument("--pool", default="", help="the pool the control plane scales this worker in")
    parser.add_argument("--registry-endpoint", help="register with the control plane's registry there")
    parser.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks")


def config_from_arguments(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model=args.model,
        role=args.role,
        request_endpoint=args.request_endpoint,
        heartbeat_endpoint=args.heartbeat_endpoint,
        worker_id=args.worker_id,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        seed=args.seed,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_waiting=args.max_waiting,
        heartbeat_interval_s=args.heartbeat_interval,
        kv_store=args.kv_store,
        kv_store_index=args.kv_store_index,
        kv_block_tokens=args.kv_block_tokens,
        kv_gc_interval_s=args.kv_gc_interval,
        kv_store_capacity_bytes=args.kv_store_capacity_bytes,
        kv_eviction_policy=args.kv_eviction_policy,
        pool=args.pool,
        registry_endpoint=args.registry_endpoint,
        ep_size=args.ep_size,
    )


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.worker", description=__doc__.splitlines()[0])
    add_worker_arguments(parser)
    configure_logging()
    run_worker_process(config_from_arguments(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
