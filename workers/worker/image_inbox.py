"""The images a request waits for on the worker that computes its prompt (mixed or prefill).

A GenerateRequest with images names them (ImageRef: content hash, placeholder tokens); an encode
worker sends each image's embeddings to the same ROUTER as an ImageEmbeddingsDelivery and a raw frame
(workers.protocol.images). The gateway sends the request and the encode request at once, over other
connections, so nothing orders the two: a delivery may come first. The inbox holds a request until
every image's delivery is there and then hands it back with its ImageEmbeddings in prompt order,
for the engine (which checks them against the model and the prompt). It holds a delivery that came
before its request for up to EARLY_HOLD_S, and EARLY_MAX_BYTES of them in all (the oldest go first).

A delivery that does not fit its request (another image's hash or token count, another image count,
a raw frame of the wrong length) fails the request ("invalid_request", naming the field), now or when
the request comes; a request whose deliveries do not all come within `timeout_s` fails
"encode_failed". Deliveries for a request that stopped waiting (admitted, failed, aborted) are dropped.

This class holds no sockets and no clock: the worker gives it the time, sends what it answers, and
asks it for the requests that waited too long between two loops.
"""

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from workers.protocol.images import EMBEDDING_DTYPE_BYTES, ImageEmbeddings, ImageEmbeddingsDelivery
from workers.protocol.messages import MAX_IMAGES_PER_REQUEST, GenerateRequest

log = logging.getLogger(__name__)

# How long a delivery that came before its request waits for it: the gateway sends both at once, so
# the request is milliseconds behind, seconds on a loaded host.
EARLY_HOLD_S = 10.0
# The most bytes of such deliveries held at once (a few large images' embeddings, some requests' worth).
EARLY_MAX_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Ready:
    """Every image of the request is there: add it to the engine with `images`."""

    peer: bytes
    request: GenerateRequest
    images: tuple[ImageEmbeddings, ...]


@dataclass(frozen=True, slots=True)
class Failed:
    """The request stopped waiting: tell `peer` (its owner) this GenerateError."""

    peer: bytes
    request_id: str
    kind: str
    message: str


Settled = Ready | Failed


@dataclass(slots=True)
class _Waiting:
    peer: bytes
    request: GenerateRequest
    deadline: float  # time.monotonic()
    images: dict[int, ImageEmbeddings] = field(default_factory=dict)  # by image index


@dataclass(slots=True)
class _Early:
    """What came for a request not here yet: its deliveries, or why one was refused."""

    arrived: float  # the first one's time.monotonic()
    deliveries: list[tuple[ImageEmbeddingsDelivery, bytes]] = field(default_factory=list)
    refusal: str = ""
    num_bytes: int = 0


class ImageInbox:
    def __init__(
        self, timeout_s: float, *, early_hold_s: float = EARLY_HOLD_S, early_max_bytes: int = EARLY_MAX_BYTES
    ) -> None:
        """`timeout_s`: how long a request waits for its images, from its arrival."""
        self.timeout_s = timeout_s
        self.early_hold_s = early_hold_s
        self.early_max_bytes = early_max_bytes
        self.waiting: dict[str, _Waiting] = {}
        self.early: OrderedDict[str, _Early] = OrderedDict()  # by first arrival, oldest first
        self.early_bytes = 0
        self._ended: dict[str, float] = {}  # request id → when it stopped waiting; kept early_hold_s

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def __len__(self) -> int:
        return len(self.waiting)

    @property
    def holding(self) -> bool:
        """Whether anything here may expire (`expired` has work to do)."""
        return bool(self.waiting or self.early or self._ended)

    def peers(self) -> dict[str, bytes]:
        """Request id → its owner, for every waiting request."""
        return {request_id: waiting.peer for request_id, waiting in self.waiting.items()}

    def wait(self, peer: bytes, request: GenerateRequest, now: float) -> Settled | None:
        """Hold a request with images (its id not in use here) until they are all there; what the
        deliveries that came before it settled."""
        request_id = request.request_id
        waiting = self.waiting[request_id] = _Waiting(peer, request, now + self.timeout_s)
        self._ended.pop(request_id, None)
        early = self.early.pop(request_id, None)
        if early is None:
            return None
        self.early_bytes -= early.num_bytes
        if early.refusal:
            return self._fail(request_id, early.refusal, now)
        for delivery, data in early.deliveries:
            settled = self._add(waiting, delivery, data, now)
            if settled is not None:
                return settled
        return None

    def deliver(self, delivery: ImageEmbeddingsDelivery, data: bytes, now: float) -> Settled | None:
        """One image's embeddings: what they settled for their request, if it is here."""
        problem = delivery_problem(delivery, data)
        if problem:
            return self.refuse(delivery.request_id, problem, now)
        waiting = self.waiting.get(delivery.request_id)
        if waiting is not None:
            return self._add(waiting, delivery, data, now)
        if delivery.request_id not in self._ended:
            self._hold(delivery.request_id, now, delivery=(delivery, data))
        return None

    def refuse(self, request_id: str, reason: str, now: float) -> Settled | None:
        """A delivery for `request_id` that is refused for `reason`: its request fails, now or when it
        comes."""
        log.warning("refused image embeddings for %s: %s", request_id, reason)
        if request_id in self.waiting:
            return self._fail(request_id, reason, now)
        if request_id not in self._ended:
            self._hold(request_id, now, refusal=reason)
        return None

    def drop(self, request_id: str, now: float) -> _Waiting | None:
        """Forget a request (aborted) and what came for it; what still comes for it is dropped. The
        waiting request, None if it was not waiting."""
        self._end(request_id, now)
        early = self.early.pop(request_id, None)
        if early is not None:
            self.early_bytes -= early.num_bytes
        return self.waiting.pop(request_id, None)

    def expired(self, now: float) -> list[Failed]:
        """The requests that waited too long, failed; deliveries held too long are dropped."""
        while self.early and next(iter(self.early.values())).arrived + self.early_hold_s <= now:
            request_id, early = self.early.popitem(last=False)
            self.early_bytes -= early.num_bytes
            log.warning("dropped image embeddings for %s: no request came within %g s", request_id, self.early_hold_s)
        self._ended = {request_id: at for request_id, at in self._ended.items() if at + self.early_hold_s > now}
        failed = []
        for waiting in [waiting for waiting in self.waiting.values() if waiting.deadline <= now]:
            request_id, num_images = waiting.request.request_id, len(waiting.request.images)
            message = (
                f"the embeddings of {num_images - len(waiting.images)} of its {num_images} images did not "
                f"arrive within {self.timeout_s:g} s"
            )
            failed.append(self._fail(request_id, message, now, kind="encode_failed"))
        return failed

    def _add(self, waiting: _Waiting, delivery: ImageEmbeddingsDelivery, data: bytes, now: float) -> Settled | None:
        request = waiting.request
        mismatch = request_mismatch(delivery, request)
        if mismatch:
            return self.refuse(request.request_id, mismatch, now)
        # A second delivery of an image (an encode request retried on another encoder) is the same
        # image: the first stays.
        waiting.images.setdefault(
            delivery.image_index,
            ImageEmbeddings(
                content_hash=delivery.content_hash,
                num_tokens=delivery.num_tokens,
                dtype=delivery.dtype,
                shape=tuple(delivery.shape),
                data=data,
            ),
        )
        if len(waiting.images) < len(request.images):
            return None
        del self.waiting[request.request_id]
        self._end(request.request_id, now)
        return Ready(waiting.peer, request, tuple(waiting.images[index] for index in range(len(request.images))))

    def _fail(self, request_id: str, message: str, now: float, *, kind: str = "invalid_request") -> Failed:
        waiting = self.waiting.pop(request_id)
        self._end(request_id, now)
        return Failed(waiting.peer, request_id, kind, message)

    def _end(self, request_id: str, now: float) -> None:
        self._ended[request_id] = now

    def _hold(
        self,
        request_id: str,
        now: float,
        *,
        delivery: tuple[ImageEmbeddingsDelivery, bytes] | None = None,
        refusal: str = "",
    ) -> None:
        early = self.early.get(request_id)
        if early is None:
            early = self.early[request_id] = _Early(now)
        if refusal and not early.refusal:
            # The request fails when it comes: its deliveries are of no use any more.
            early.refusal = refusal
            early.deliveries.clear()
            self.early_bytes -= early.num_bytes
            early.num_bytes = 0
        elif delivery is not None and not early.refusal:
            early.deliveries.append(delivery)
            early.num_bytes += len(delivery[1])
            self.early_bytes += len(delivery[1])
        while self.early_bytes > self.early_max_bytes:
            dropped_id, dropped = self.early.popitem(last=False)
            self.early_bytes -= dropped.num_bytes
            log.warning("dropped image embeddings for %s: past %d bytes held early", dropped_id, self.early_max_bytes)


def check_refs(request: GenerateRequest, image_token_id: int | None) -> str:
    """Why a request's images cannot fit the model and its prompt ("" when they may): refused before
    it waits for embeddings that could never be used. The engine checks the embeddings themselves."""
    if image_token_id is None:
        return "images: this model takes no images (it is a text-only model)"
    placeholders = sum(1 for token in request.prompt_token_ids if token == image_token_id)
    filled = sum(image.num_tokens for image in request.images)
    if placeholders != filled:
        return (
            f"images: the prompt has {placeholders} image placeholder tokens (id {image_token_id}) but the "
            f"images' num_tokens add up to {filled}"
        )
    return ""


def delivery_problem(delivery: ImageEmbeddingsDelivery, data: bytes) -> str:
    """Why a delivery does not describe itself and its raw frame consistently ("" when it does)."""
    index, num_images = delivery.image_index, delivery.num_images
    if not 1 <= num_images <= MAX_IMAGES_PER_REQUEST:
        return f"image_embeddings.num_images must be 1 to {MAX_IMAGES_PER_REQUEST}, got {num_images}"
    if not 0 <= index < num_images:
        return f"image_embeddings.image_index must be in [0, {num_images}), got {index}"
    name = f"images[{index}]"
    element = EMBEDDING_DTYPE_BYTES.get(delivery.dtype)
    if element is None:
        return f"{name}.dtype must be one of {', '.join(EMBEDDING_DTYPE_BYTES)}, got {delivery.dtype!r}"
    shape = tuple(delivery.shape)
    if len(shape) != 2 or shape[0] != delivery.num_tokens or min(shape) < 1:
        return f"{name}.shape must be [num_tokens ({delivery.num_tokens}), hidden_size], got {list(shape)}"
    expected = math.prod(shape) * element
    if len(data) != expected:
        size = f"{shape[0]} x {shape[1]} {delivery.dtype}"
        return f"{name}.data: the raw frame must be {expected} bytes ({size}), got {len(data)}"
    return ""


def request_mismatch(delivery: ImageEmbeddingsDelivery, request: GenerateRequest) -> str:
    """Why a (self-consistent) delivery is not of one of the request's images ("" when it is)."""
    refs = request.images
    if delivery.num_images != len(refs):
        return f"image_embeddings.num_images is {delivery.num_images}; the request names {len(refs)} images"
    index = delivery.image_index
    ref = refs[index]
    if delivery.content_hash != ref.content_hash:
        return (
            f"images[{index}].content_hash: the embeddings delivered are of image {delivery.content_hash.hex()[:16]}, "
            f"the request's is {ref.content_hash.hex()[:16]}"
        )
    if delivery.num_tokens != ref.num_tokens:
        return (
            f"images[{index}].num_tokens: the embeddings delivered have {delivery.num_tokens}, "
            f"the request's image {ref.num_tokens}"
        )
    return ""
