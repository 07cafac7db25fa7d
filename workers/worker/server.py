"""The worker's server: its sockets, the loop that interleaves messages with engine steps, and the
table of message handlers (see the package docstring for the roles).

Faults: a request that fails on its own (its constraint, its output; see LLMEngine.fail_request)
gets a GenerateError and the others run on. An engine step that raises is a fault of the engine as
a whole: every request the worker holds gets a "worker_failed" error at once, rather than waiting
for the heartbeats to stop, and the worker exits (code 1) for its supervisor to restart it.
"""

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from workers import curve
from workers.engine.engine_core import EngineCore
from workers.engine.outputs import RequestDelta, RequestFailure, output_of
from workers.engine.request import FinishReason
from workers.kvstore.checkpoint_files import FOLDER as CHECKPOINTS_FOLDER
from workers.kvstore.gc import GarbageCollector
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import EngineOverloadedError, InvalidConstraintError, InvalidRequestError
from workers.protocol.images import ImageEmbeddings, ImageEmbeddingsDelivery
from workers.protocol.messages import (
    AbortRequest,
    ApplyEPLayoutRequest,
    ControlRequest,
    DeclineMigrationRequest,
    DrainRequest,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    MigrateRequest,
    ResumeDecodeRequest,
    ResumeRequest,
    SetTTLPolicyRequest,
    ShutdownRequest,
    StatusRequest,
    SwaLayers,
    WorkerInbound,
    WorkerOutbound,
)
from workers.protocol.sampling_params import invalid_request_from
from workers.transfer.link import TransferReceiver, TransferSender
from workers.worker.args import WorkerArgs
from workers.worker.checkpoints import Checkpoints, DirectoryStorage, RedisStorage
from workers.worker.control import WorkerControl
from workers.worker.heartbeats import Heartbeats, WorkerIdentity, registration
from workers.worker.image_inbox import ImageInbox, Ready, Settled, check_refs
from workers.worker.migration import Migration
from workers.worker.registry import registration_thread
from workers.worker.resumption import Resumption
from workers.worker.swa_holder import open_swa_holder
from workers.worker.transfers import Transfers

log = logging.getLogger(__name__)

# Inbound messages handled between two engine steps, so a flood of requests cannot stall decoding.
MAX_MESSAGES_PER_STEP = 256
CLOSE_LINGER_MS = 500  # time to flush the final outputs of aborted requests at shutdown
COPY_POLL_MS = 1  # how often an idle worker looks whether KV being copied in is there


class Worker:
    def __init__(
        self,
        config: WorkerArgs,
        engine: EngineCore,
        context: zmq.Context,
        stop: threading.Event,
        collector: GarbageCollector | None = None,
        *,
        key: curve.CurveKey | None = None,
    ) -> None:
        """`key`: the cluster's CURVE key, for every socket the rule of workers.curve secures."""
        self.config = config
        self.engine = engine
        self.stop = stop
        bound = bind_worker_sockets(config, context, key)
        self.worker_id, self.router, publisher = bound.identity.worker_id, bound.router, bound.publisher
        advertised_host = bound.advertised_host
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        receiver: TransferReceiver | None = None
        transfer_endpoint = ""
        if config.role == "decode":
            router = context.socket(zmq.ROUTER)
            curve.bind(router, config.transfer_endpoint, key)
            transfer_endpoint = connectable_endpoint(router, advertised_host)
            receiver = TransferReceiver(
                router, default_timeout_s=config.transfer_timeout_s, kv_layout=engine.info.kv_layout
            )
            self.poller.register(router, zmq.POLLIN)
        sender: TransferSender | None = None
        # Prefill workers send every request's KV; decode workers send their requests' when a drain
        # migrates them.
        if config.role in ("prefill", "decode"):
            sender = TransferSender(context, key=key)
            self.poller.register(sender.results, zmq.POLLIN)
        spec = engine.info.swa_state_spec
        self.swa = open_swa_holder(config, engine, context, worker_id=self.worker_id, key=key)
        swa_layers = (
            SwaLayers(
                window=spec.window,
                num_layers=len(spec.layers),
                replay=config.engine.swa_replay,
                state_endpoint=connectable(self.swa.endpoint, advertised_host) if self.swa else "",
            )
            if spec
            else None
        )
        self.identity = dataclasses.replace(bound.identity, transfer_endpoint=transfer_endpoint)
        self.decoder = msgspec.msgpack.Decoder(WorkerInbound)
        self.encoder = msgspec.msgpack.Encoder()
        self.owners: dict[str, bytes] = {}  # request id → ROUTER identity of the peer that sent it
        # Requests with images waiting for their embeddings, which the worker's transfer timeout bounds.
        self.inbox = ImageInbox(config.transfer_timeout_s)
        self._resized_at = 0.0  # the EP group's last resize this worker has acted on
        self.control = WorkerControl(
            self.worker_id,
            ep_size=lambda: engine.ep_group().size,
            collector=collector,
            num_in_flight=self._num_in_flight,
            apply_placement=engine.apply_layout,
        )
        self.resumption = Resumption(
            worker_id=self.worker_id,
            engine=engine,
            control=self.control,
            owners=self.owners,
            send=self._send,
            checkpoints=_checkpoints(config, engine),
        )
        self.transfers = Transfers(
            worker_id=self.worker_id,
            role=config.role,
            engine=engine,
            control=self.control,
            owners=self.owners,
            send=self._send,
            receiver=receiver,
            sender=sender,
            continued=self.resumption.took_in,
            migrated=self.resumption.moved_away,
        )
        self.migration = Migration(
            engine=engine, control=self.control, transfers=self.transfers, owners=self.owners, send=self._send
        )
        self.heartbeats = Heartbeats(
            self.identity,
            config,
            engine,
            self.control,
            collector,
            publisher,
            stop,
            transfers=self.transfers,
            swa_layers=swa_layers,
        )
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            GenerateRequest: self._on_generate,
            ExpectTransferRequest: self.transfers.on_expect_transfer,
            AbortRequest: self._on_abort,
            MigrateRequest: self._on_migrate,
            DeclineMigrationRequest: self.migration.on_decline,
            ResumeDecodeRequest: self._on_resume_decode,
            DrainRequest: self._on_control,
            ResumeRequest: self._on_control,
            ShutdownRequest: self._on_shutdown,
            SetTTLPolicyRequest: self._on_control,
            ApplyEPLayoutRequest: self._on_control,
            StatusRequest: self._on_control,
        }
        self.registration_thread = registration_thread(
            context, config.registry_endpoint, registration(self.identity, config, engine), stop, key=key
        )

    def serve(self) -> None:
        log.info(
            "worker %s serving %s on %s (heartbeats on %s)",
            self.worker_id,
            self.engine.info.model_name,
            self.config.request_endpoint,
            self.config.heartbeat_endpoint,
        )
        self.heartbeats.start()
        if self.registration_thread is not None:
            self.registration_thread.start()
        while not self.stop.is_set():
            idle_ms = self._poll_timeout_ms()
            ready = dict(self.poller.poll(idle_ms))
            if self.router in ready:
                self._receive()
            if self.inbox.holding:
                for failed in self.inbox.expired(time.monotonic()):
                    self._settle(failed)
            self.transfers.poll(ready, MAX_MESSAGES_PER_STEP)
            if self.control.migrate_at is not None and self.config.role == "decode":
                self.migration.offer_due()
            if self.engine.has_unfinished():
                deltas = self._step()
                for delta in deltas:
                    self._send_delta(delta)
                self.resumption.after_step(deltas)
                self.control.check_drained()
        self._shut_down()

    def _poll_timeout_ms(self) -> float:
        """How long the loop waits for a message: not at all while the engine has work, a little
        while KV is being copied in (its request joins the batch when the copy is done), else up to a
        heartbeat interval."""
        if self.engine.has_unfinished():
            return 0
        if self.transfers.copying:
            return COPY_POLL_MS
        return self.config.heartbeat_interval_s * 1000

    def _step(self) -> list[RequestDelta]:
        try:
            deltas = self.engine.step()
        except Exception as error:
            self._fail_in_flight(f"the engine worker {self.worker_id} failed: {type(error).__name__}")
            raise
        resized_at = self.engine.ep_group().resized_at
        if resized_at != self._resized_at:
            self._resized_at = resized_at
            self.control.forget_ep_layout()
        return deltas

    def _fail_in_flight(self, reason: str) -> None:
        """Tell every peer with a request here that the worker is going, before it goes. The
        heartbeats stop first, so that a peer that has heard of the failure hears nothing that
        would make the worker look alive again."""
        log.error("worker %s: the engine failed; failing %d requests", self.worker_id, self._num_in_flight())
        self.stop.set()
        self.heartbeats.join()
        peers = {
            **self.owners,
            **self.inbox.peers(),
            **self.transfers.expected_peers(),
            **self.transfers.sending,
            **self.migration.peers(),
        }
        for request_id, peer in peers.items():
            if peer:  # b"": a send aborted by its owner, who wants nothing more
                self._send(peer, GenerateError(request_id, "worker_failed", reason))

    def _receive(self) -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames[0], frames[1:])

    def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        """One message: one frame, or two for image embeddings (the struct, then the raw bytes)."""
        wrong_count = f"expected one message frame, got {len(frames)}"
        try:
            message = self.decoder.decode(frames[0] if frames else b"")
        except msgspec.DecodeError as error:
            if len(frames) == 1:
                self._reject_malformed(peer, str(invalid_request_from(error)), frames[0])
            else:
                self._reject_malformed(peer, wrong_count, b"")
            return
        if isinstance(message, ImageEmbeddingsDelivery):
            self._guarded(peer, message, lambda: self._on_image_embeddings(peer, message, frames[1:]))
        elif len(frames) != 1:
            self._reject_malformed(peer, wrong_count, b"")
        else:
            self._guarded(peer, message, lambda: self.handlers[type(message)](peer, message))

    def _guarded(self, peer: bytes, message: Any, handle: Callable[[], None]) -> None:
        try:
            handle()
        except Exception:
            # A bug in admitting one request must not take the others down with the process.
            log.exception("handling %s failed", type(message).__name__)
            message_id = getattr(message, "request_id", None) or getattr(message, "command_id", "")
            self._send(peer, GenerateError(message_id, "internal", "the worker failed to handle the message"))

    def _on_generate(self, peer: bytes, request: GenerateRequest) -> None:
        if self.swa is not None:
            self.swa.peers.learn(request.swa_holders)
        if not self.control.accepting:
            message = f"worker {self.worker_id} is {self.control.state} and takes no new requests"
            self._send(peer, GenerateError(request.request_id, "draining", message))
            return
        if request.decode_endpoint and self.transfers.sender is None:
            message = f"worker {self.worker_id} is a {self.config.role} worker: it does not send KV"
            self._send(peer, GenerateError(request.request_id, "invalid_request", message))
            return
        if request.images:
            self._wait_for_images(peer, request)
            return
        self._admit(peer, request, ())

    def _wait_for_images(self, peer: bytes, request: GenerateRequest) -> None:
        """Hold a request with images until an encode worker has delivered every image's embeddings."""
        request_id = request.request_id
        if self.config.role == "decode":
            problem = f"images: worker {self.worker_id} is a decode worker: it computes no prompts with images"
        elif request_id in self.owners or request_id in self.inbox:
            problem = f"request id {request_id!r} is already in use"
        else:
            problem = check_refs(request, getattr(self.engine.info.model_config, "image_token_id", None))
        if problem:
            self._send(peer, GenerateError(request_id, "invalid_request", problem))
            return
        settled = self.inbox.wait(peer, request, time.monotonic())
        if settled is not None:
            self._settle(settled)

    def _on_image_embeddings(self, peer: bytes, delivery: ImageEmbeddingsDelivery, data: list[bytes]) -> None:
        """One image's embeddings from an encode worker. A refused one fails its request, whose owner
        is told (the encoder sent it and is done with it); the sender hears only of embeddings sent to
        a worker that takes none."""
        if self.config.role == "decode":
            message = f"worker {self.worker_id} is a decode worker: it takes no image embeddings"
            self._send(peer, GenerateError(delivery.request_id, "invalid_request", message))
            return
        now = time.monotonic()
        if len(data) != 1:
            reason = f"image_embeddings: a delivery is two frames (the struct, the raw bytes), got {len(data) + 1}"
            settled = self.inbox.refuse(delivery.request_id, reason, now)
        else:
            settled = self.inbox.deliver(delivery, data[0], now)
        if settled is not None:
            self._settle(settled)

    def _settle(self, settled: Settled) -> None:
        """A request whose images are all there goes to the engine; one that failed waiting is told."""
        if isinstance(settled, Ready):
            self._admit(settled.peer, settled.request, settled.images)
        else:
            self._send(settled.peer, GenerateError(settled.request_id, settled.kind, settled.message))
            self.control.check_drained()

    def _admit(self, peer: bytes, request: GenerateRequest, images: tuple[ImageEmbeddings, ...]) -> None:
        try:
            self.engine.add_request(
                EngineRequest(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=request.params,
                    cache_namespace=request.cache_namespace,
                    constraint=request.constraint,
                    prompt_logprobs=request.prompt_logprobs,
                    traffic_class=request.traffic_class,
                    prefill_only=bool(request.decode_endpoint),
                    tenant=request.tenant,
                    tenant_weight=request.tenant_weight,
                    cache_hints=request.cache_hints,
                    images=images,
                )
            )
        except InvalidConstraintError as error:
            self._send(peer, GenerateError(request.request_id, "invalid_constraint", str(error)))
        except InvalidRequestError as error:
            self._send(peer, GenerateError(request.request_id, "invalid_request", str(error)))
        except EngineOverloadedError as error:
            self._send(peer, GenerateError(request.request_id, "overloaded", str(error)))
        else:
            self.owners[request.request_id] = peer
            if request.decode_endpoint:
                self.transfers.send_after_prefill(request.request_id, request.decode_endpoint)

    def _on_abort(self, peer: bytes, request: AbortRequest) -> None:
        self._abort(request.request_id)
        self.control.check_drained()

    def _on_migrate(self, peer: bytes, request: MigrateRequest) -> None:
        self.migration.on_migrate(peer, request)

    def _on_resume_decode(self, peer: bytes, request: ResumeDecodeRequest) -> None:
        if self.config.role != "decode":
            message = f"worker {self.worker_id} is a {self.config.role} worker: it resumes no decoding"
            self._send(peer, GenerateError(request.request.request_id, "invalid_request", message))
            return
        if request.request.images:
            # A checkpoint keeps no embeddings, and a resume recomputes the prompt's tail: the gateway
            # reruns an image request from its prompt instead, its images encoded again.
            message = "an image request is not resumed from a checkpoint: its images' embeddings are not kept"
            self._send(peer, GenerateError(request.request.request_id, "checkpoint_invalid", message))
            return
        self.resumption.on_resume_decode(peer, request)

    def _on_control(self, peer: bytes, request: ControlRequest) -> None:
        self._send(peer, self.control.handle(request))

    def _on_shutdown(self, peer: bytes, request: ShutdownRequest) -> None:
        """Abort what is in flight before acknowledging, so the ack confirms nothing is left running."""
        for request_id in [*self.owners, *self.inbox.waiting, *self.transfers.expected, *self.migration.offered]:
            self._abort(request_id)
        self._on_control(peer, request)
        log.info("worker %s shutting down (command %s)", self.worker_id, request.command_id)
        self.stop.set()

    def _abort(self, request_id: str) -> None:
        """Stop a request; its owner gets a last output with finish_reason "abort" (a request whose KV
        is being sent has reported its last output: sending stops, and its pages go when it has)."""
        waiting = self.inbox.drop(request_id, time.monotonic())
        if waiting is not None:
            # It never reached the engine: its last output is the one a queued request's abort gives.
            prompt_length = len(waiting.request.prompt_token_ids)
            self._send(
                waiting.peer,
                GenerateOutput(request_id, [], "", finish_reason="abort", num_prompt_tokens=prompt_length),
            )
            return
        if self.transfers.abort(request_id) or self.migration.forget(request_id):
            return
        delta = self.engine.abort_request(request_id)
        if delta is not None:
            self._send_delta(delta)

    def _num_in_flight(self) -> int:
        return len(self.owners) + len(self.inbox) + self.transfers.num_in_flight + self.migration.num_offered

    def _send_delta(self, delta: RequestDelta) -> None:
        owner = self.owners.pop(delta.request_id) if delta.finished else self.owners[delta.request_id]
        if delta.failure is not None:
            self.transfers.forget(delta.request_id)
            self._send(owner, failure_error(delta.request_id, delta.failure))
            return
        self._send(owner, output_of(delta))
        if delta.finish_reason == FinishReason.TRANSFER:
            self.transfers.start_send(delta.request_id, owner)
        elif delta.finished:
            self.transfers.forget(delta.request_id)

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
        if not isinstance(request_id, str) or any(
            request_id in in_flight for in_flight in (self.owners, self.inbox.waiting, self.transfers.sending)
        ):
            return ""
        return request_id

    def _send(self, peer: bytes, message: WorkerOutbound) -> None:
        # A ROUTER drops messages to peers that are gone rather than blocking.
        self.router.send_multipart([peer, self.encoder.encode(message)])

    def _shut_down(self) -> None:
        """Abort what is in flight, so that every stream ends with an output rather than a timeout."""
        log.info("worker %s stopping; aborting %d requests", self.worker_id, self._num_in_flight())
        in_flight = [*self.owners, *self.inbox.waiting, *self.transfers.sending, *self.transfers.expected]
        for request_id in [*in_flight, *self.migration.offered]:
            self._abort(request_id)
        self.transfers.close()
        self.resumption.close()
        if self.swa is not None:
            self.swa.close()
        self.router.close(linger=CLOSE_LINGER_MS)
        self.heartbeats.join()
        if self.registration_thread is not None:
            self.registration_thread.join()
        self.heartbeats.publisher.close(linger=0)


def _checkpoints(config: WorkerArgs, engine: EngineCore) -> Checkpoints | None:
    """A decode worker with a KV store checkpoints its requests where the store's index is: in Redis
    with the Redis index, beside the block files otherwise."""
    if config.role != "decode" or engine.kv_store is None or config.engine.kv_store is None:
        return None
    index = engine.kv_store.index
    storage = (
        RedisStorage(index.client, index.prefix)  # a workers.kvstore.redis_index.RedisIndex
        if config.engine.kv_store_index.startswith(("redis://", "rediss://"))
        else DirectoryStorage(Path(config.engine.kv_store) / CHECKPOINTS_FOLDER)
    )
    return Checkpoints(storage, block_tokens=engine.info.kv_block_tokens, kv_model_id=engine.info.kv_model_id)


def failure_error(request_id: str, failure: RequestFailure) -> GenerateError:
    """A request that failed alone, as its owner hears of it: its constraint's failure in full (the
    client's own grammar), anything else without detail (that is for this worker's log)."""
    if failure.kind == "constraint":
        return GenerateError(request_id, "invalid_constraint", failure.message)
    log.error("request %s failed: %s", request_id, failure.message)
    return GenerateError(request_id, "internal", "the worker failed to process this request's output")


@dataclass(frozen=True, slots=True)
class BoundWorkerSockets:
    """A worker's request ROUTER and heartbeat PUB, bound, and its identity as peers see it."""

    router: zmq.Socket
    publisher: zmq.Socket
    identity: WorkerIdentity  # transfer_endpoint "": a decode worker sets its own
    advertised_host: str


def bind_worker_sockets(config: WorkerArgs, context: zmq.Context, key: curve.CurveKey | None) -> BoundWorkerSockets:
    """The sockets every worker role binds (engine worker and encoder alike), and its name: --worker-id,
    else <hostname>-<pid>; its endpoints as other hosts connect to them (connectable_endpoint)."""
    hostname = socket.gethostname()
    advertised_host = config.advertise_host or hostname
    router = context.socket(zmq.ROUTER)
    curve.bind(router, config.request_endpoint, key)
    publisher = context.socket(zmq.PUB)
    curve.bind(publisher, config.heartbeat_endpoint, key)
    identity = WorkerIdentity(
        worker_id=config.worker_id or f"{hostname}-{os.getpid()}",
        hostname=hostname,
        started_at=time.time(),
        request_endpoint=connectable_endpoint(router, advertised_host),
        heartbeat_endpoint=connectable_endpoint(publisher, advertised_host),
        transfer_endpoint="",
    )
    return BoundWorkerSockets(router, publisher, identity, advertised_host)


def connectable_endpoint(bound: zmq.Socket, advertised_host: str) -> str:
    """The endpoint a socket is bound to, as a peer on another host connects to it: a wildcard TCP
    address names `advertised_host` (--advertise-host, else this host's name) instead, and port 0 the
    port the system chose."""
    return connectable(bound.getsockopt_string(zmq.LAST_ENDPOINT), advertised_host)


def connectable(endpoint: str, advertised_host: str) -> str:
    """A bound endpoint (as ZMQ_LAST_ENDPOINT names it) as a peer on another host connects to it."""
    scheme, _, address = endpoint.partition("://")
    host, _, port = address.rpartition(":")
    if scheme == "tcp" and host in ("0.0.0.0", "[::]", "*"):
        return f"tcp://{advertised_host}:{port}"
    return endpoint
