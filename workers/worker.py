"""An engine worker process: serves GenerateRequests over ZMQ and publishes heartbeats.

Sockets: a ROUTER (requests and control commands in; each request's outputs and each command's
ControlAck go back to the peer that sent it) and a PUB (heartbeats, sent by their own thread). While
the engine has work, the loop checks its sockets without blocking between steps; when idle it blocks
on them for up to a heartbeat interval. With a registry endpoint, a thread announces the worker there.

Roles: a "mixed" worker runs whole requests. A "prefill" worker runs a request that names a
`decode_endpoint` up to its first token, then sends the KV there on its sender thread and releases
the pages once sent (workers.transfer_link). A "decode" worker also binds a PULL, its transfer
endpoint: it continues the requests whose KV arrives there, streaming their outputs to the peer that
sent the ExpectTransferRequest. Either role still runs a plain GenerateRequest whole, so a pool that
has lost all of its other half keeps serving.

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
from typing import Any

import msgspec
import torch
import zmq

from workers.engine.builder import build_engine
from workers.engine.constraints import TokenConstraint
from workers.engine.engine import LLMEngine
from workers.engine.errors import EngineOverloadedError, InvalidRequestError
from workers.engine.outputs import RequestDelta
from workers.engine.request import FinishReason
from workers.engine.sampling_params import invalid_request_from
from workers.kvstore.eviction import get_policy
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.index import IndexUsage
from workers.kvstore.store import KVStore
from workers.kvstore.ttl import TTLPolicy
from workers.protocol import (
    AbortRequest,
    ApplyEPLayoutRequest,
    ControlRequest,
    DrainRequest,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    OutputConstraintSpec,
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
from workers.transfer_link import Received, SendResult, TransferReceiver, TransferSender
from workers.worker_config import WorkerConfig, add_worker_arguments, config_from_arguments
from workers.worker_control import WorkerControl

log = logging.getLogger(__name__)

PROCESS_TITLE = "sluice-worker"  # /proc/self/comm keeps 15 bytes
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Inbound messages handled between two engine steps, so a flood of requests cannot stall decoding.
MAX_MESSAGES_PER_STEP = 256
CLOSE_LINGER_MS = 500  # time to flush the final outputs of aborted requests at shutdown


def run_worker_process(config: WorkerConfig) -> None:
    """The worker's entry point: returns after SIGTERM/SIGINT or a ShutdownRequest; a crash is logged
    and exits 1."""
    _set_process_title(PROCESS_TITLE)
    _die_with_parent()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        engine = build_engine(config.engine)
        store = engine.store.store if engine.store is not None else None
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
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.receiver: TransferReceiver | None = None
        self.transfer_endpoint = ""
        if config.role == "decode":
            pull = context.socket(zmq.PULL)
            pull.bind(config.transfer_endpoint)
            self.transfer_endpoint = connectable_endpoint(pull, self.hostname)
            self.receiver = TransferReceiver(pull, config.transfer_timeout_s)
            self.poller.register(pull, zmq.POLLIN)
        self.sender: TransferSender | None = None
        if config.role == "prefill":
            self.sender = TransferSender(context)
            self.poller.register(self.sender.results, zmq.POLLIN)
        self.decode_endpoints: dict[str, str] = {}  # request id → where its KV goes after prefill
        self.sending: dict[str, bytes] = {}  # request id → owner, while its KV is being sent
        # Heartbeats come from their own thread: one engine step (a long prefill on a CPU) can take
        # seconds, longer than a client waits before it declares the worker dead. The PUB socket is
        # used by that thread alone (ZMQ sockets are not thread-safe).
        self.heartbeat_thread = threading.Thread(target=self._publish_heartbeats, name="heartbeats", daemon=True)
        self.decoder = msgspec.msgpack.Decoder(WorkerInbound)
        self.encoder = msgspec.msgpack.Encoder()
        self.owners: dict[str, bytes] = {}  # request id → ROUTER identity of the peer that sent it
        self.control = WorkerControl(
            self.worker_id, ep_size=config.ep_size, collector=collector, num_in_flight=self._num_in_flight
        )
        self.collector = collector
        self.store_usage = IndexUsage(num_blocks=0, num_bytes=0)  # the last read, kept when a read fails
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            GenerateRequest: self._on_generate,
            ExpectTransferRequest: self._on_expect_transfer,
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
            ready = dict(self.poller.poll(idle_ms))
            if self.router in ready:
                self._receive()
            if self.receiver is not None:
                if self.receiver.pull in ready:
                    for received in self.receiver.receive(MAX_MESSAGES_PER_STEP):
                        self._continue_transfer(received)
                for received in self.receiver.expired(time.monotonic()):
                    self._continue_transfer(received)
            if self.sender is not None and self.sender.results in ready:
                self._finish_sends(self.sender.take_results())
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
        if request.decode_endpoint and self.sender is None:
            message = f"worker {self.worker_id} is a {self.config.role} worker: it does not send KV"
            self._send(peer, GenerateError(request.request_id, "invalid_request", message))
            return
        try:
            constraint = self._compile_constraint(request.constraint) if request.constraint is not None else None
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                cache_namespace=request.cache_namespace,
                constraint=constraint,
                prompt_logprobs=request.prompt_logprobs,
                traffic_class=request.traffic_class,
                prefill_only=bool(request.decode_endpoint),
            )
        except InvalidRequestError as error:
            self._send(peer, GenerateError(request.request_id, "invalid_request", str(error)))
        except EngineOverloadedError as error:
            self._send(peer, GenerateError(request.request_id, "overloaded", str(error)))
        else:
            self.owners[request.request_id] = peer
            if request.decode_endpoint:
                self.decode_endpoints[request.request_id] = request.decode_endpoint

    def _on_expect_transfer(self, peer: bytes, request: ExpectTransferRequest) -> None:
        request_id = request.request_id
        if self.receiver is None:
            message = f"worker {self.worker_id} is a {self.config.role} worker: it takes no KV transfers"
            self._send(peer, GenerateError(request_id, "invalid_request", message))
        elif not self.control.accepting:
            message = f"worker {self.worker_id} is {self.control.state} and takes no new requests"
            self._send(peer, GenerateError(request_id, "draining", message))
        elif request_id in self.owners or request_id in self.receiver.expected:
            message = f"request id {request_id!r} is already in use"
            self._send(peer, GenerateError(request_id, "invalid_request", message))
        else:
            self.receiver.expect(request_id, peer, request.constraint)

    def _continue_transfer(self, received: Received) -> None:
        """A transfer this worker expected completed or failed: admit the request, or tell its owner."""
        peer, request_id = received.expectation.peer, received.request_id
        error = received.error
        if received.handoff is not None:
            try:
                spec = received.expectation.constraint
                constraint = self._compile_constraint(spec) if spec is not None else None
                self.engine.add_prefilled_request(received.handoff, constraint=constraint)
            except (InvalidRequestError, EngineOverloadedError) as refusal:
                error = str(refusal)
            else:
                self.owners[request_id] = peer
                return
        log.warning("KV transfer of %s failed: %s", request_id, error)
        self._send(peer, GenerateError(request_id, "transfer_failed", error))
        self.control.check_drained()

    def _finish_sends(self, results: list[SendResult]) -> None:
        """The sender thread is done with these handoffs: their pages can go."""
        for result in results:
            self.engine.release_transfer(result.request_id)
            owner = self.sending.pop(result.request_id, None)
            if result.error and owner is not None:
                self._send(owner, GenerateError(result.request_id, "transfer_failed", result.error))
        self.control.check_drained()

    def _compile_constraint(self, spec: OutputConstraintSpec) -> TokenConstraint:
        # Imported here: grammar compilation is recipe's job and only constrained requests need it.
        from recipe.constraints import compile_constraint

        if self.engine.tokenizer is None:
            raise InvalidRequestError("output constraints need a tokenizer; this model was loaded without one")
        return compile_constraint(spec, self.engine.tokenizer, self.engine.model_config.vocab_size)

    def _on_abort(self, peer: bytes, request: AbortRequest) -> None:
        self._abort(request.request_id)
        self.control.check_drained()

    def _on_control(self, peer: bytes, request: ControlRequest) -> None:
        self._send(peer, self.control.handle(request))

    def _on_shutdown(self, peer: bytes, request: ShutdownRequest) -> None:
        """Abort what is in flight before acknowledging, so the ack confirms nothing is left running."""
        expected = list(self.receiver.expected) if self.receiver is not None else []
        for request_id in [*self.owners, *expected]:
            self._abort(request_id)
        self._on_control(peer, request)
        log.info("worker %s shutting down (command %s)", self.worker_id, request.command_id)
        self.stop.set()

    def _abort(self, request_id: str) -> None:
        """Stop a request; its owner gets a last output with finish_reason "abort" (a request whose KV
        is being sent has reported its last output: sending stops, and its pages go when it has)."""
        if request_id in self.sending:
            self.sending[request_id] = b""  # its owner gets no transfer_failed for this
            self.sender.cancel(request_id)
            return
        expectation = self.receiver.drop(request_id) if self.receiver is not None else None
        if expectation is not None:
            self._send(expectation.peer, GenerateOutput(request_id, [], "", finish_reason="abort"))
            return
        delta = self.engine.abort_request(request_id)
        if delta is not None:
            self._send_delta(delta)

    def _num_in_flight(self) -> int:
        expected = len(self.receiver.expected) if self.receiver is not None else 0
        return len(self.owners) + len(self.sending) + expected

    def _send_delta(self, delta: RequestDelta) -> None:
        owner = self.owners.pop(delta.request_id) if delta.finished else self.owners[delta.request_id]
        decode_endpoint = self.decode_endpoints.pop(delta.request_id, "") if delta.finished else ""
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
        if delta.finish_reason == FinishReason.TRANSFER:
            self.sending[delta.request_id] = owner
            self.sender.submit(delta.request_id, decode_endpoint, self.engine.export_kv(delta.request_id))

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
        if not isinstance(request_id, str) or request_id in self.owners or request_id in self.sending:
            return ""
        return request_id

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
        store_usage = self._read_store_usage()
        collector = self.collector
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
            transfer_endpoint=self.transfer_endpoint,
            kv_capacity_tokens=stats.num_pages * self.engine.config.page_size,
            cost_model_error_p50=stats.cost_model_error[0],
            cost_model_error_p90=stats.cost_model_error[1],
            max_num_seqs=self.config.engine.max_num_seqs,
            kv_model_id=self.engine.kv_model_id,
            kv_block_tokens=self.engine.store.block_tokens if self.engine.store is not None else 0,
            kv_store_bytes=store_usage.num_bytes,
            kv_store_blocks=store_usage.num_blocks,
            kv_store_capacity_bytes=collector.capacity_bytes if collector else 0,
            kv_store_low_watermark=collector.low_watermark if collector else 0.0,
            kv_store_high_watermark=collector.high_watermark if collector else 0.0,
            kv_store_evicted_expired=collector.evicted_expired if collector else 0,
            kv_store_evicted_capacity=collector.evicted_capacity if collector else 0,
        )
        self.publisher.send(self.encoder.encode(heartbeat))

    def _read_store_usage(self) -> IndexUsage:
        """The store index's totals; a shared (Redis) index that fails to answer must not stop the
        heartbeats, which would make the worker look dead, so the last totals read stand in."""
        if self.engine.store is None:
            return self.store_usage
        try:
            self.store_usage = self.engine.store.store.index.usage()
        except Exception:
            log.warning("reading the KV store index's usage failed", exc_info=True)
        return self.store_usage

    def _registration(self) -> WorkerRegistration:
        device = torch.device(self.config.engine.device)
        on_cuda = device.type == "cuda"
        return WorkerRegistration(
            worker_id=self.worker_id,
            pool=self.config.pool,
            role=self.config.role,
            model=self.engine.model_name,
            hostname=self.hostname,
            request_endpoint=self.request_endpoint,
            heartbeat_endpoint=self.heartbeat_endpoint,
            transfer_endpoint=self.transfer_endpoint,
            ep_size=self.config.ep_size,
            num_accelerators=1 if on_cuda else 0,
            accelerator_kind=torch.cuda.get_device_name(device) if on_cuda else device.type,
            started_at=self.started_at,
        )

    def _shut_down(self) -> None:
        """Abort what is in flight, so that every stream ends with an output rather than a timeout."""
        log.info("worker %s stopping; aborting %d requests", self.worker_id, self._num_in_flight())
        expected = list(self.receiver.expected) if self.receiver is not None else []
        for request_id in [*self.owners, *self.sending, *expected]:
            self._abort(request_id)
        if self.sender is not None:
            self._finish_sends(self.sender.close())
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


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.worker", description=__doc__.splitlines()[0])
    add_worker_arguments(parser)
    configure_logging()
    run_worker_process(config_from_arguments(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
