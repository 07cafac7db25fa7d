"""The image inbox on its own, with the time given: deliveries held before their request expire and
are bounded in bytes (the oldest go), a request that waits too long fails "encode_failed", a repeated
delivery keeps the first, and what comes for a request that stopped waiting is dropped."""

import numpy as np

from workers.protocol.images import ImageEmbeddingsDelivery, ImageRef
from workers.protocol.messages import GenerateRequest
from workers.protocol.sampling_params import SamplingParams
from workers.worker.image_inbox import Failed, ImageInbox, Ready

HIDDEN = 4
TOKENS = (3, 2)
HASHES = (b"a" * 32, b"b" * 32)
PROMPT = [1, 9, 9, 9, 2, 9, 9, 3]  # 9: the image token


def embeddings(index: int, fill: float = 0.0) -> bytes:
    return np.full((TOKENS[index], HIDDEN), fill + index, dtype=np.float32).tobytes()


def delivery(request_id: str, index: int) -> ImageEmbeddingsDelivery:
    return ImageEmbeddingsDelivery(
        request_id, index, len(TOKENS), HASHES[index], TOKENS[index], "float32", (TOKENS[index], HIDDEN)
    )


def request(request_id: str) -> GenerateRequest:
    images = tuple(ImageRef(h, t) for h, t in zip(HASHES, TOKENS, strict=True))
    return GenerateRequest(request_id, PROMPT, SamplingParams(max_tokens=4), images=images)


def test_deliveries_before_and_after_the_request_make_it_ready_with_its_images_in_order():
    inbox = ImageInbox(timeout_s=5.0)
    assert inbox.deliver(delivery("r", 1), embeddings(1), now=0.0) is None
    assert inbox.wait(b"owner", request("r"), now=0.1) is None
    assert "r" in inbox and len(inbox) == 1

    ready = inbox.deliver(delivery("r", 0), embeddings(0), now=0.2)

    assert isinstance(ready, Ready) and ready.peer == b"owner" and ready.request.request_id == "r"
    assert [image.data for image in ready.images] == [embeddings(0), embeddings(1)]
    assert [image.content_hash for image in ready.images] == list(HASHES)
    assert len(inbox) == 0 and inbox.early_bytes == 0


def test_a_repeated_delivery_keeps_the_first():
    inbox = ImageInbox(timeout_s=5.0)
    inbox.wait(b"owner", request("r"), now=0.0)
    inbox.deliver(delivery("r", 0), embeddings(0), now=0.1)
    assert inbox.deliver(delivery("r", 0), embeddings(0, fill=7.0), now=0.2) is None

    ready = inbox.deliver(delivery("r", 1), embeddings(1), now=0.3)

    assert isinstance(ready, Ready) and ready.images[0].data == embeddings(0)


def test_a_refused_delivery_before_its_request_fails_it_when_it_comes():
    inbox = ImageInbox(timeout_s=5.0)
    inbox.deliver(delivery("r", 0), embeddings(0)[:-4], now=0.0)

    failed = inbox.wait(b"owner", request("r"), now=0.1)

    assert isinstance(failed, Failed) and failed.kind == "invalid_request" and failed.peer == b"owner"
    assert "images[0].data" in failed.message
    assert "r" not in inbox


def test_a_request_that_waits_past_its_timeout_fails_encode_failed():
    inbox = ImageInbox(timeout_s=2.0)
    inbox.wait(b"owner", request("r"), now=10.0)
    inbox.deliver(delivery("r", 0), embeddings(0), now=10.5)

    assert inbox.expired(now=11.9) == []
    (failed,) = inbox.expired(now=12.0)

    assert (failed.request_id, failed.kind, failed.peer) == ("r", "encode_failed", b"owner")
    assert "1 of its 2 images did not arrive within 2 s" in failed.message
    assert len(inbox) == 0


def test_early_deliveries_expire_and_are_bounded_in_bytes_oldest_first():
    size = len(embeddings(0))
    inbox = ImageInbox(timeout_s=5.0, early_hold_s=1.0, early_max_bytes=2 * size)
    inbox.deliver(delivery("old", 0), embeddings(0), now=0.0)
    inbox.deliver(delivery("mid", 0), embeddings(0), now=0.5)
    inbox.deliver(delivery("new", 0), embeddings(0), now=0.6)  # past the bound: "old" goes

    assert list(inbox.early) == ["mid", "new"] and inbox.early_bytes == 2 * size
    inbox.expired(now=1.5)  # "mid" arrived 1 s ago
    assert list(inbox.early) == ["new"] and inbox.early_bytes == size
    # The dropped deliveries are gone: their request waits for them anew.
    assert inbox.wait(b"owner", request("old"), now=1.6) is None
    assert inbox.waiting["old"].images == {}


def test_what_comes_for_an_aborted_request_is_dropped_not_held():
    inbox = ImageInbox(timeout_s=5.0, early_hold_s=1.0)
    inbox.wait(b"owner", request("r"), now=0.0)
    inbox.deliver(delivery("r", 0), embeddings(0), now=0.1)

    dropped = inbox.drop("r", now=0.2)
    late = inbox.deliver(delivery("r", 1), embeddings(1), now=0.3)

    assert dropped is not None and dropped.peer == b"owner"
    assert late is None and "r" not in inbox and inbox.early == {}
    inbox.expired(now=1.3)
    assert not inbox.holding
