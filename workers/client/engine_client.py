"""The gateway's side of the workers: sends GenerateRequests and streams their outputs back (asyncio).

Per worker one DEALER (requests out, outputs in) and one SUB (its heartbeats). One receive task per
DEALER sorts outputs into per-request queues, so any number of concurrent streams share a socket.
A worker is healthy while its heartbeats keep coming; when they stop (or it restarts, losing its
requests), the streams it was serving fail with WorkerUnavailableError instead of waiting forever.
New requests go only to healthy workers whose heartbeats say they are "ready" (not draining).

Every request's stream goes through workers.client.split_stream: with ready prefill and decode workers
the request is split between them, its outputs still arriving as one stream; otherwise one worker
runs it whole (mixed workers, or a pool that lost its other half).

A request with images (GenerateRequest.images) has them encoded by an encode worker at the same time
as its prompt is sent to the worker that computes it (workers.client.encoders). Encoders are followed
like the other workers (add_worker: their heartbeats say role "encode"), and never run a request.

Over the network both sockets are CURVE clients (workers.curve) holding the cluster's key.

A request that fails on its own ends with RequestRejectedError ("invalid_constraint", "internal")
and the worker goes on; one on a worker that failed as a whole ("worker_failed", or its heartbeats
stop) is a crash suspect: tried again at most once, and never on the last worker able to serve
requests (workers.client.split_stream, workers.client.crash_suspects); otherwise it fails "worker_failed".
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from workers import curve
from workers.client.crash_suspects import CrashSuspects
from workers.client.dead_holders import DeadHolders
from workers.client.encoders import ENCODE, ImageEncoding, check_images
from workers.client.prefill_deadlines import DeadlineModel
from workers.client.routing.router import Router, cost_model_from_environment, fitted_cost_model_from_environment
from workers.client.split_stream import SplitStream
from workers.client.worker_link import RequestRejectedError, StreamItem, WorkerLink, WorkerUnavailableError
from workers.eplb.expert_loads import ExpertLoadCounts
from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.protocol.encode import EncodeDone, EncodeImage, EncoderInbound, EncoderOutbound
from workers.protocol.messages import (
    HEARTBEAT_TIMEOUT_S,
    AbortRequest,
    ControlAck,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    WorkerHeartbeat,
    WorkerInbound,
    WorkerOutbound,
)

log = logging.getLogger(__name__)

CLOSE_LINGER_MS = 200  # time to deliver the aborts of streams still open at close


class EngineClient:
    def __init__(
        self,
        context: zmq.asyncio.Context | None = None,
        *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        store_index: BlockIndex | None = None,
        holders: HolderIndex | None = None,
        router: Router | None = None,
        deadline_model: DeadlineModel | None = None,
        key: curve.CurveKey | None = None,
        max_image_pixels: int | None = None,
    ) -> None:
        """`store_index`: the global KV store's index, shared with the workers (Redis), from which a
        request's hit length is read to weigh its prefill work; None: every prompt counts whole.
        `deadline_model`: how long a split request's prefill path may take (default: from the
        fitted cost model, else the conservative rate). `key`: the cluster's CURVE key. `holders`: the
        SWA holder index beside the store's (workers.kvstore.store.open_holders), from which a sliding-
        window model's hits are routed as its workers will use them; a worker this client finds dead
        has its registrations dropped there (workers.client.dead_holders). `max_image_pixels`: the
        gateway's bound on an image's pixels (SLUICE_MAX_IMAGE_PIXELS), which encoders re-check while
        decoding (EncodeRequest.max_pixels); None: this client takes no requests with images."""
        self.store_index = store_index
        self.holders = holders
        self.router = router or Router(cost_model_from_environment())
        self.deadline_model = deadline_model or DeadlineModel(
            fitted_cost_model_from_environment(), step_budget_s=self.router.step_budget_s
        )
        self.max_image_pixels = max_image_pixels
        self.crash_suspects = CrashSuspects()
        self.closed = False
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._key = key
        # Heartbeats count expert loads since the previous one, so every one is summed here, not
        # only the latest kept; the telemetry collector takes the sums.
        self.expert_loads = ExpertLoadCounts()
        self._links: list[WorkerLink] = []
        self._dead_holders = DeadHolders(holders) if holders is not None else None
        self._tasks: list[asyncio.Task[None]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(WorkerOutbound | EncoderOutbound)
        self._heartbeat_decoder = msgspec.msgpack.Decoder(WorkerHeartbeat)

    def add_worker(self, request_endpoint: str, heartbeat_endpoint: str) -> None:
        """Follow the worker (an encoder too); curve.CurveError when its endpoints need a key this client lacks."""
        curve.check_endpoints([request_endpoint, heartbeat_endpoint], self._key)
        dealer = self._context.socket(zmq.DEALER)
        curve.connect(dealer, request_endpoint, self._key)
        subscriber = self._context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        curve.connect(subscriber, heartbeat_endpoint, self._key)
        link = WorkerLink(request_endpoint, dealer, subscriber)
        self._links.append(link)
        if self._tasks:  # already started
            self._start_link_tasks(link)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch_heartbeats(), name="engine-client-watchdog"))
        for link in self._links:
            self._start_link_tasks(link)

    async def close(self) -> None:
        self.closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._dead_holders is not None:
            await self._dead_holders.wait()
        for link in self._links:
            for request_id in link.streams if link.role != ENCODE else ():
                self.send_now(link, AbortRequest(request_id))
            link.fail_streams("the engine client closed")
            link.dealer.close(linger=CLOSE_LINGER_MS)
            link.subscriber.close(linger=0)
        self._links.clear()
        if self._own_context:
            self._context.term()

    def healthy_workers(self) -> list[WorkerHeartbeat]:
        now = time.monotonic()
        return [link.heartbeat for link in self._links if link.is_healthy(now, self._heartbeat_timeout_s)]

    async def generate(
        self, request: GenerateRequest, images: tuple[EncodeImage, ...] = ()
    ) -> AsyncIterator[GenerateOutput]:
        """The request's outputs, up to the one with a finish_reason. `images`: the images that
        request.images names, one for one, with their data, which an encoder turns into embeddings
        for the worker computing the prompt (workers.client.encoders).

        Raises WorkerUnavailableError (no ready worker, or none left to try) or
        RequestRejectedError ("encode_failed": no encoder, or two, could encode the images). A
        consumer that stops early (break, cancellation) aborts the request. A worker that refuses
        the request as draining never started it: it goes to another ready worker. Failures are
        retried as split_stream describes.
        """
        if any(request.request_id in other.streams for other in self._links):
            raise RequestRejectedError("invalid_request", f"request id {request.request_id!r} is already in use")
        check_images(request, images)
        if images and self.max_image_pixels is None:
            raise RequestRejectedError("internal", "this engine client was built without max_image_pixels: no images")
        stream = SplitStream(self, request, images).outputs()
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield output

    async def generate_whole(
        self, request: GenerateRequest, link: WorkerLink, encoding: ImageEncoding | None = None
    ) -> AsyncIterator[GenerateOutput]:
        """The request run start to end on `link`, once: a worker's GenerateError ends it as a
        RequestRejectedError (also "draining"), the worker going away as WorkerUnavailableError.
        `encoding`: its images' encoding for `link`, started with the request and over at its first
        output."""
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        link.streams[request.request_id] = queue
        ended = True  # the worker has not been sent the request, or has forgotten it: nothing to abort
        try:
            if encoding is not None:
                await encoding.start()
            ended = False
            await link.dealer.send(self._encoder.encode(request))
            while True:
                item = await queue.get()
                if encoding is not None:  # the images arrived (or the attempt is over)
                    encoding.stop()
                if isinstance(item, WorkerUnavailableError):
                    ended = True
                    raise item
                if isinstance(item, GenerateError):
                    ended = True
                    raise RequestRejectedError(item.kind, item.message)
                ended = item.finish_reason is not None
                yield item
                if ended:
                    return
        finally:
            if encoding is not None:
                encoding.stop()
            if link.streams.get(request.request_id) is queue:
                del link.streams[request.request_id]
            if not ended:
                self.send_now(link, AbortRequest(request.request_id))

    async def abort(self, request_id: str) -> None:
        """Ask the workers that have the request to stop it; its stream then ends with finish_reason
        "abort"."""
        for link in self._links:
            if request_id in link.streams and link.role != ENCODE:
                await link.dealer.send(self._encoder.encode(AbortRequest(request_id)))

    def ready_links(self) -> list[WorkerLink]:
        """The engine workers ready for requests (encoders are not)."""
        now = time.monotonic()
        return [link for link in self._links if link.is_ready(now, self._heartbeat_timeout_s) and link.role != ENCODE]

    def ready_encoders(self) -> list[WorkerLink]:
        now = time.monotonic()
        return [link for link in self._links if link.is_ready(now, self._heartbeat_timeout_s) and link.role == ENCODE]

    async def send(self, link: WorkerLink, message: WorkerInbound | EncoderInbound) -> None:
        await link.dealer.send(self._encoder.encode(message))

    def send_now(self, link: WorkerLink, message: WorkerInbound | EncoderInbound) -> None:
        """Send without awaiting, for cleanup paths that may run while being cancelled or closed."""
        if link.dealer.closed:
            return
        try:
            link.dealer.send(self._encoder.encode(message), zmq.NOBLOCK).add_done_callback(_log_send_error)
        except zmq.ZMQError as error:
            log.warning("could not send %s to %s: %s", type(message).__name__, link.request_endpoint, error)

    def _start_link_tasks(self, link: WorkerLink) -> None:
        name = link.request_endpoint
        self._tasks.append(asyncio.create_task(self._receive_outputs(link), name=f"engine-client-outputs {name}"))
        self._tasks.append(asyncio.create_task(self._receive_heartbeats(link), name=f"engine-client-heartbeats {name}"))

    async def _receive_outputs(self, link: WorkerLink) -> None:
        while True:
            payload = await link.dealer.recv()
            try:
                message = self._output_decoder.decode(payload)
            except msgspec.DecodeError as error:
                log.error("undecodable message from worker %s: %s", link.request_endpoint, error)
                continue
            if isinstance(message, ControlAck):  # control commands come from the control plane, not from here
                log.warning("unexpected control ack from worker %s: %s", link.request_endpoint, message)
                continue
            if isinstance(message, GenerateError) and message.kind == "worker_failed":
                link.mark_failed()
            if isinstance(message, EncodeDone | GenerateError):
                link.encoding_patches.pop(message.request_id, None)
            queue = link.streams.get(message.request_id)
            if queue is not None:
                queue.put_nowait(message)
            elif isinstance(message, GenerateError):
                log.warning("worker %s reports an error: %s: %s", link.request_endpoint, message.kind, message.message)

    async def _receive_heartbeats(self, link: WorkerLink) -> None:
        while True:
            payload = await link.subscriber.recv()
            try:
                heartbeat = self._heartbeat_decoder.decode(payload)
            except msgspec.DecodeError as error:
                log.error("undecodable heartbeat from worker %s: %s", link.request_endpoint, error)
                continue
            if link.heartbeat is not None and heartbeat.started_at != link.heartbeat.started_at:
                link.fail_streams(f"worker {link.request_endpoint} restarted")
            link.heartbeat = heartbeat
            link.heartbeat_received_at = time.monotonic()
            self.expert_loads.add(heartbeat)

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_timeout_s / 4)
            now = time.monotonic()
            for link in self._links:
                if self._dead_holders is not None and not link.is_healthy(now, self._heartbeat_timeout_s):
                    self._dead_holders.found_dead(link.heartbeat)
                if link.streams and not link.is_healthy(now, self._heartbeat_timeout_s):
                    log.warning(
                        "worker %s sent no heartbeat for %.1f s",
                        link.request_endpoint,
                        now - link.heartbeat_received_at,
                    )
                    link.fail_streams(f"worker {link.request_endpoint} stopped sending heartbeats")


def _log_send_error(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("send failed: %s", future.exception())
