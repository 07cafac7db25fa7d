"""The encode worker's server: its sockets, the loop that interleaves messages with vision-tower
batches, and the table of message handlers.

An EncodeRequest is checked whole when it arrives (workers.worker.encoder.images): a bad one gets a
GenerateError "invalid_request" naming the field and nothing is sent for it. Each of its images is
then taken from the embedding cache and sent at once, or queued for the vision tower
(workers.worker.encoder.batching) and sent when its last tile is encoded. Once every image went to
the destination, the gateway gets EncodeDone. While the queue holds tiles the loop checks its socket
without blocking between batches; when idle it blocks on it for up to a heartbeat interval.

Faults: a vision-tower batch that raises is a fault of the encoder as a whole: every request in
flight gets "encode_failed" at once (the gateway sends it to another encoder) and the process exits
(code 1) for its supervisor to restart it.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from workers import curve
from workers.engine.parallel.placement import Placement, PlacementError
from workers.protocol.encode import EncodeDone, EncodeRequest, EncoderInbound, EncoderOutbound
from workers.protocol.errors import InvalidRequestError
from workers.protocol.images import ImageEmbeddingsDelivery
from workers.protocol.messages import (
    ApplyEPLayoutRequest,
    ControlRequest,
    DrainRequest,
    GenerateError,
    ResumeRequest,
    SetTTLPolicyRequest,
    ShutdownRequest,
    StatusRequest,
)
from workers.protocol.sampling_params import invalid_request_from
from workers.worker.args import WorkerArgs
from workers.worker.control import WorkerControl
from workers.worker.encoder.batching import TileQueue
from workers.worker.encoder.destinations import Destinations
from workers.worker.encoder.embedding_cache import EmbeddingCache, Embeddings
from workers.worker.encoder.heartbeats import EncoderHeartbeats, EncoderLoad, encoder_registration
from workers.worker.encoder.images import CheckedImage, check_image
from workers.worker.encoder.vision import VisionModel, load_vision_model
from workers.worker.registry import registration_thread
from workers.worker.server import CLOSE_LINGER_MS, bind_worker_sockets

log = logging.getLogger(__name__)

# Inbound messages handled between two batches, so a flood of requests cannot stall encoding.
MAX_MESSAGES_PER_BATCH = 256
# Patches an encoder holds, in largest batches: a request that would go past them is refused
# ("overloaded") unless the encoder holds nothing, so that one large request still runs.
MAX_QUEUED_BATCHES = 32


@dataclass(eq=False)
class EncodeJob:
    """One EncodeRequest in flight."""

    request_id: str
    peer: bytes  # the gateway's ROUTER identity
    destination: str
    num_images: int
    num_patches: int
    num_unsent: int  # images whose embeddings have not gone to the destination yet
    num_cached: int = 0


class EncodeServer:
    def __init__(
        self,
        config: WorkerArgs,
        model: VisionModel,
        context: zmq.Context,
        stop: threading.Event,
        *,
        key: curve.CurveKey | None = None,
    ) -> None:
        """`key`: the cluster's CURVE key, for every socket the rule of workers.curve secures."""
        self.config = config
        self.model = model
        self.stop = stop
        bound = bind_worker_sockets(config, context, key)
        self.router, publisher, self.identity = bound.router, bound.publisher, bound.identity
        self.worker_id = self.identity.worker_id
        self.max_tiles = max(1, config.max_encode_patches // model.patches_per_tile)
        self.max_queued_patches = MAX_QUEUED_BATCHES * self.max_tiles * model.patches_per_tile
        self.cache = EmbeddingCache(config.embedding_cache_bytes)
        self.queue = TileQueue(model.settings)
        self.destinations = Destinations(context, key)
        self.requests: dict[str, EncodeJob] = {}
        self.load = EncoderLoad()
        self.control = WorkerControl(
            self.worker_id,
            ep_size=lambda: 1,
            collector=None,
            num_in_flight=lambda: len(self.requests),
            apply_placement=_no_experts,
        )
        self.heartbeats = EncoderHeartbeats(
            self.identity, config, model, self.control, self.load, self.cache, publisher, stop
        )
        self.decoder = msgspec.msgpack.Decoder(EncoderInbound)
        self.encoder = msgspec.msgpack.Encoder()
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            EncodeRequest: self._on_encode,
            DrainRequest: self._on_control,
            ResumeRequest: self._on_control,
            ShutdownRequest: self._on_shutdown,
            SetTTLPolicyRequest: self._on_control,
            ApplyEPLayoutRequest: self._on_control,
            StatusRequest: self._on_control,
        }
        self.registration_thread = registration_thread(
            context, config.registry_endpoint, encoder_registration(self.identity, config, model), stop, key=key
        )

    def serve(self) -> None:
        self.measure_throughput()
        log.info(
            "encoder %s serving %s on %s (heartbeats on %s): %d tiles per batch, %.0f patches/s",
            self.worker_id,
            self.model.name,
            self.config.request_endpoint,
            self.config.heartbeat_endpoint,
            self.max_tiles,
            self.load.patches_per_second,
        )
        self.heartbeats.start()
        if self.registration_thread is not None:
            self.registration_thread.start()
        while not self.stop.is_set():
            idle_ms = 0 if self.queue else self.config.heartbeat_interval_s * 1000
            if self.router.poll(idle_ms):
                self._receive()
            self.destinations.discard_replies()
            if self.queue and not self.stop.is_set():
                self._encode_next_batch()
        self._shut_down()

    def measure_throughput(self) -> None:
        """The vision tower's patches per second at its largest batch (the autoscaler's capacity of one
        encoder): one batch at that size warms it up (allocations, kernel choices), the next is timed.
        Tiles of zeros cost what images do."""
        side = self.model.settings.tile_side
        pixels = np.zeros((self.max_tiles, 3, side, side), dtype=np.float32)
        self.model.encode(pixels)
        started = time.perf_counter()
        self.model.encode(pixels)  # returns on the CPU: the device's work is done
        elapsed = time.perf_counter() - started
        self.load.patches_per_second = self.max_tiles * self.model.patches_per_tile / max(elapsed, 1e-9)

    def _receive(self) -> None:
        for _ in range(MAX_MESSAGES_PER_BATCH):
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
            self._send(peer, GenerateError(message_id, "internal", "the encoder failed to handle the message"))

    def _on_encode(self, peer: bytes, request: EncodeRequest) -> None:
        request_id = request.request_id
        if not self.control.accepting:
            message = f"encoder {self.worker_id} is {self.control.state} and takes no new requests"
            self._send(peer, GenerateError(request_id, "draining", message))
            return
        if request_id in self.requests:
            self._send(peer, GenerateError(request_id, "invalid_request", f"request_id {request_id!r} is in flight"))
            return
        claimed = sum(image.num_patches for image in request.images)
        if self.requests and self.load.patches_in_flight + claimed > self.max_queued_patches:
            message = f"encoder {self.worker_id} holds {self.load.patches_in_flight} patches; it takes no more now"
            self._send(peer, GenerateError(request_id, "overloaded", message))
            return
        try:
            self.destinations.check(request.destination)
            images = [
                check_image(
                    image,
                    f"images[{index}]",
                    max_pixels=request.max_pixels,
                    settings=self.model.settings,
                    patches_per_tile=self.model.patches_per_tile,
                )
                for index, image in enumerate(request.images)
            ]
        except InvalidRequestError as error:
            self._send(peer, GenerateError(request_id, "invalid_request", str(error)))
            return
        job = EncodeJob(
            request_id=request_id,
            peer=peer,
            destination=request.destination,
            num_images=len(images),
            num_patches=sum(image.num_patches for image in images),
            num_unsent=len(images),
        )
        self.requests[request_id] = job
        self.load.num_in_flight = len(self.requests)
        self.load.patches_in_flight += job.num_patches
        for index, image in enumerate(images):
            cached = self.cache.get(image.content_hash)
            if cached is None:
                self.queue.add(image, (job, index))
            elif self.requests.get(request_id) is job:  # not failed by an earlier image's send
                job.num_cached += 1
                self._deliver(job, index, image, cached)

    def _encode_next_batch(self) -> None:
        try:
            batch = self.queue.next_batch(self.max_tiles)
            embeddings = self.model.encode(batch.pixels)
        except Exception as error:
            self._fail_in_flight(f"the encoder {self.worker_id} failed: {type(error).__name__}")
            raise
        self.load.num_patches_encoded += batch.pixels.shape[0] * self.model.patches_per_tile
        dtype = str(embeddings.dtype).removeprefix("torch.")
        for image in self.queue.complete(batch, embeddings):
            rows = image.outputs[0].contiguous()
            encoded = Embeddings(data=rows.view(torch.uint8).numpy().tobytes(), dtype=dtype, shape=tuple(rows.shape))
            self.cache.put(image.checked.content_hash, encoded)
            for job, index in image.waiters:
                if self.requests.get(job.request_id) is job:
                    self._deliver(job, index, image.checked, encoded)

    def _deliver(self, job: EncodeJob, index: int, image: CheckedImage, embeddings: Embeddings) -> None:
        header = ImageEmbeddingsDelivery(
            request_id=job.request_id,
            image_index=index,
            num_images=job.num_images,
            content_hash=image.content_hash,
            num_tokens=image.num_tokens,
            dtype=embeddings.dtype,
            shape=embeddings.shape,
        )
        if not self.destinations.send(job.destination, [self.encoder.encode(header), embeddings.data]):
            message = f"the destination {job.destination} takes no more embeddings"
            self._finish(job, GenerateError(job.request_id, "encode_failed", message))
            return
        job.num_unsent -= 1
        if job.num_unsent == 0:
            self._finish(job, EncodeDone(job.request_id, num_patches=job.num_patches, num_cached=job.num_cached))

    def _finish(self, job: EncodeJob, answer: EncoderOutbound) -> None:
        """The request's last message to the gateway; its images still queued are encoded all the same
        (for the cache and for other requests waiting on them)."""
        del self.requests[job.request_id]
        self.load.num_in_flight = len(self.requests)
        self.load.patches_in_flight -= job.num_patches
        self._send(job.peer, answer)
        self.control.check_drained()

    def _fail_in_flight(self, reason: str) -> None:
        """Tell every gateway with a request here that the encoder is going, before it goes. The
        heartbeats stop first, so that nothing makes the encoder look alive after the failure."""
        log.error("encoder %s: the vision tower failed; failing %d requests", self.worker_id, len(self.requests))
        self.stop.set()
        self.heartbeats.join()
        self._fail_requests(reason)

    def _on_control(self, peer: bytes, request: ControlRequest) -> None:
        self._send(peer, self.control.handle(request))

    def _on_shutdown(self, peer: bytes, request: ShutdownRequest) -> None:
        """Fail what is in flight before acknowledging, so the ack confirms nothing is left running."""
        self._fail_requests(f"the encoder {self.worker_id} is shutting down")
        self._on_control(peer, request)
        log.info("encoder %s shutting down (command %s)", self.worker_id, request.command_id)
        self.stop.set()

    def _fail_requests(self, reason: str) -> None:
        for job in list(self.requests.values()):
            self._finish(job, GenerateError(job.request_id, "encode_failed", reason))

    def _reject_malformed(self, peer: bytes, reason: str, payload: bytes) -> None:
        log.warning("malformed message from peer %s: %s", peer.hex(), reason)
        self._send(peer, GenerateError(self._readable_request_id(payload), "invalid_request", reason))

    def _readable_request_id(self, payload: bytes) -> str:
        """The request id of an undecodable message when its envelope is still readable, so that the
        sender's wait for it ends; "" when unknown, or when it names a request in flight."""
        try:
            fields = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            return ""
        request_id = fields.get("request_id") if isinstance(fields, dict) else None
        return request_id if isinstance(request_id, str) and request_id not in self.requests else ""

    def _send(self, peer: bytes, message: EncoderOutbound) -> None:
        # A ROUTER drops messages to peers that are gone rather than blocking.
        self.router.send_multipart([peer, self.encoder.encode(message)])

    def _shut_down(self) -> None:
        """Fail what is in flight, so that every gateway's wait ends with an answer, not a timeout."""
        log.info("encoder %s stopping; failing %d requests", self.worker_id, len(self.requests))
        self._fail_requests(f"the encoder {self.worker_id} stopped")
        self.destinations.close()
        self.router.close(linger=CLOSE_LINGER_MS)
        self.heartbeats.join()
        if self.registration_thread is not None:
            self.registration_thread.join()
        self.heartbeats.publisher.close(linger=0)


def run_encoder(config: WorkerArgs, stop: threading.Event, key: curve.CurveKey | None) -> None:
    """Load the vision tower, serve until `stop` or a ShutdownRequest; a failure raises."""
    model = load_vision_model(config.engine)
    context = zmq.Context()
    try:
        EncodeServer(config, model, context, stop, key=key).serve()
    finally:
        context.destroy(linger=CLOSE_LINGER_MS)


def _no_experts(num_logical_experts: int, placement: Placement) -> None:
    raise PlacementError("an encode worker has no experts to place")
