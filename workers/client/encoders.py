"""The encode workers as the gateway's engine client sees them: which one encodes a request's images,
and the encoding of one attempt's images, tried on a second encoder when the first fails.

Encoders are links like the engine workers (workers.client.worker_link): found the same way, a
DEALER and a SUB each, CURVE as every link; their heartbeats say role "encode", and they are never
chosen to compute a request. The balancer picks the ready encoder with the fewest patches in flight:
those its last heartbeat reports plus those this client sent it since and has not seen done or
failed; ties go to the one with the fewest requests, then to the one the first image's content hash
ranks first (rendezvous hashing), so the same image meets the same encoder's embedding cache.

An attempt's encoding (ImageEncoding) sends the EncodeRequest, with the request endpoint that the
worker computing the prompt advertises as its destination, at the same time as the attempt sends
that worker the GenerateRequest. EncodeDone leaves nothing to do: the worker streams the outputs.
An encoder's GenerateError other than "invalid_request", or its heartbeats stopping, sends the
request to another encoder; an encoder that failed a request is not tried for it again, and the
second failure (or no other encoder ready) ends the request "encode_failed". The request is then
aborted on the worker, and the attempt's stream ends with that error: it is put on the worker's
stream as the worker's own errors are, so the attempt ends the way a worker's refusal ends it. Once
the worker's first output shows the images arrived, the encoding is over, whatever its encoder
still answers.
"""

import asyncio
import logging
from collections.abc import Sequence
from hashlib import blake2b
from typing import Protocol

from workers.client.worker_link import RequestRejectedError, StreamItem, WorkerLink, WorkerUnavailableError
from workers.protocol.encode import EncodeDone, EncodeImage, EncodeRequest, EncoderInbound
from workers.protocol.messages import AbortRequest, GenerateError, GenerateRequest, WorkerInbound

log = logging.getLogger(__name__)

ENCODE = "encode"  # an encode worker's role
# Encoders one request may fail on before it fails "encode_failed": the first failure is retried once.
MAX_ENCODE_FAILURES = 2
INVALID_REQUEST = "invalid_request"
ENCODE_FAILED = "encode_failed"


def patches_in_flight(link: WorkerLink) -> int:
    return link.heartbeat.patches_in_flight + sum(link.encoding_patches.values())


def requests_in_flight(link: WorkerLink) -> int:
    beat = link.heartbeat
    return max(len(link.encoding_patches), beat.num_running + beat.num_waiting)


def fewest_patches(encoders: Sequence[WorkerLink], affinity: bytes = b"") -> WorkerLink:
    """The encoder with the fewest patches in flight, then the fewest requests; among encoders as
    loaded, the one `affinity` (the request's first image's content hash) ranks first by rendezvous
    hashing, so an image sent again while the pool is idle meets the encoder whose embedding cache
    holds it rather than being encoded on another."""
    return min(
        encoders,
        key=lambda link: (patches_in_flight(link), requests_in_flight(link), _rendezvous(affinity, link)),
    )


def _rendezvous(affinity: bytes, link: WorkerLink) -> bytes:
    return blake2b(affinity + link.request_endpoint.encode(), digest_size=8).digest()


def check_images(request: GenerateRequest, images: Sequence[EncodeImage]) -> None:
    """RequestRejectedError "invalid_request" naming the field when `images` are not the images the
    request names (GenerateRequest.images), one for one in order."""
    if len(images) != len(request.images):
        raise RequestRejectedError(
            INVALID_REQUEST,
            f"images: the request names {len(request.images)} images (GenerateRequest.images) but "
            f"{len(images)} were given to encode",
        )
    for index, (image, ref) in enumerate(zip(images, request.images, strict=True)):
        if image.content_hash != ref.content_hash or image.num_tokens != ref.num_tokens:
            raise RequestRejectedError(
                INVALID_REQUEST,
                f"images[{index}]: its content_hash and num_tokens must be those of GenerateRequest.images[{index}]",
            )


class EncodingClient(Protocol):
    """What an encoding uses of the engine client (workers.client.engine_client.EngineClient)."""

    def ready_encoders(self) -> list[WorkerLink]: ...

    async def send(self, link: WorkerLink, message: WorkerInbound | EncoderInbound) -> None: ...

    def send_now(self, link: WorkerLink, message: WorkerInbound | EncoderInbound) -> None: ...


class ImageEncoding:
    """The encoding of one attempt's images for the worker `destination` computing the prompt, where
    the request goes under `request_id`. `failed`: the encoders that failed this request, kept by its
    stream across attempts; `max_pixels`: the pixel bound the encoder re-checks (EncodeRequest)."""

    def __init__(
        self,
        client: EncodingClient,
        request_id: str,
        images: tuple[EncodeImage, ...],
        destination: WorkerLink,
        failed: set[WorkerLink],
        max_pixels: int,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.images = images
        self.destination = destination
        self.failed = failed
        self.max_pixels = max_pixels
        self.num_patches = sum(image.num_patches for image in images)
        self.encoder: WorkerLink | None = None
        self._answers: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Send the EncodeRequest to the encoder the balancer picks; RequestRejectedError
        "encode_failed" at once when no encoder is ready. Called once the destination's stream for
        the request is open, so that a failure finds it."""
        await self._send(self._choose("no encoder is available for the request's images"))
        self._task = asyncio.create_task(self._watch(), name=f"image-encoding {self.request_id}")

    def stop(self) -> None:
        """The images arrived at the destination, or the attempt is over: stop following the encoder.
        Its patches count against it until it answers or goes away."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._close_stream()

    def _choose(self, reason: str) -> WorkerLink:
        encoders = [link for link in self.client.ready_encoders() if link not in self.failed]
        if not encoders:
            raise RequestRejectedError(ENCODE_FAILED, f"{reason} (request {self.request_id})")
        return fewest_patches(encoders, self.images[0].content_hash)

    async def _send(self, encoder: WorkerLink) -> None:
        self.encoder = encoder
        encoder.streams[self.request_id] = self._answers
        encoder.encoding_patches[self.request_id] = self.num_patches
        destination = self.destination.heartbeat.request_endpoint
        request = EncodeRequest(self.request_id, self.images, destination, self.max_pixels)
        await self.client.send(encoder, request)

    async def _watch(self) -> None:
        while True:
            answer = await self._answers.get()
            if isinstance(answer, EncodeDone):
                self._close_stream()
                return
            if isinstance(answer, GenerateError) and answer.kind == INVALID_REQUEST:
                self._end(INVALID_REQUEST, answer.message)
                return
            if not isinstance(answer, GenerateError | WorkerUnavailableError):
                log.warning("unexpected answer from encoder %s: %s", self.encoder.request_endpoint, answer)
                continue
            if isinstance(answer, GenerateError) and answer.kind == "draining":
                self.encoder.mark_draining()  # not chosen again until its heartbeat says otherwise
            reason = f"encoder {self.encoder.request_endpoint} failed: {_describe(answer)}"
            self._close_stream()
            self.failed.add(self.encoder)
            if len(self.failed) >= MAX_ENCODE_FAILURES:
                self._end(ENCODE_FAILED, f"the request's images failed on {len(self.failed)} encoders; last: {reason}")
                return
            try:
                encoder = self._choose(f"{reason}, and no other encoder is available")
            except RequestRejectedError as error:
                self._end(ENCODE_FAILED, error.message)
                return
            log.warning("encoding request %s again on %s: %s", self.request_id, encoder.request_endpoint, reason)
            await self._send(encoder)

    def _end(self, kind: str, message: str) -> None:
        """Abort the request on the destination and end the attempt's stream there with the error."""
        self._close_stream()
        self.client.send_now(self.destination, AbortRequest(self.request_id))
        sink = self.destination.streams.get(self.request_id)
        if sink is not None:
            sink.put_nowait(GenerateError(self.request_id, kind, message))

    def _close_stream(self) -> None:
        if self.encoder is not None and self.encoder.streams.get(self.request_id) is self._answers:
            del self.encoder.streams[self.request_id]


def _describe(answer: GenerateError | WorkerUnavailableError) -> str:
    if isinstance(answer, GenerateError):
        return f"{answer.kind}: {answer.message}"
    return str(answer)
