"""Messages of the vision-encoder boundary: gateway ⇄ encode worker (its request ROUTER).

The gateway picks an encode worker (fewest patches in flight) and sends it an EncodeRequest at the
same time as it sends the GenerateRequest, whose `images` name the same images by content hash, to
the worker that computes the prompt (`destination`). The encode worker decodes and preprocesses each
image, takes its embeddings from its cache (keyed by content hash) or runs the vision tower on it,
sends each image's embeddings to `destination` as an ImageEmbeddingsDelivery (workers.protocol.images)
followed by one raw frame, and then answers the gateway with EncodeDone, or with a GenerateError
(kinds "invalid_request", "overloaded", "draining", "encode_failed") for the request. An encoder
also takes the control requests of workers.protocol.messages (drain, resume, shutdown, status),
answered with a ControlAck, and publishes WorkerHeartbeats of role "encode".
"""

from typing import Annotated

import msgspec

from workers.protocol.messages import MAX_IMAGES_PER_REQUEST, ControlAck, ControlRequest, GenerateError


class EncodeImage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image as the gateway read it: the encoded file as sent or fetched (PNG, JPEG...), already
    decoded once there within the request limits; the content hash of its pixels
    (workers.text.image_hash); its vision-tower patches (tiles × patches per tile) and placeholder
    tokens as the gateway counted them from its size (workers.text.idefics3_images)."""

    content_hash: bytes
    data: bytes
    num_patches: Annotated[int, msgspec.Meta(ge=1)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]


class EncodeRequest(msgspec.Struct, tag="encode", frozen=True, forbid_unknown_fields=True):
    request_id: str
    images: Annotated[tuple[EncodeImage, ...], msgspec.Meta(min_length=1, max_length=MAX_IMAGES_PER_REQUEST)]
    # The request endpoint of the worker computing the prompt, where the embeddings go.
    destination: Annotated[str, msgspec.Meta(min_length=1)]
    # Pixel bound the encoder re-checks while decoding (the gateway's SLUICE_MAX_IMAGE_PIXELS).
    max_pixels: Annotated[int, msgspec.Meta(ge=1)]


class EncodeDone(msgspec.Struct, tag="encode_done", frozen=True, forbid_unknown_fields=True):
    """Every image's embeddings were sent to the destination."""

    request_id: str
    num_patches: int  # the request's vision-tower patches (tiles × patches per tile)
    num_cached: int  # images whose embeddings came from the encoder's cache


EncoderInbound = EncodeRequest | ControlRequest
EncoderOutbound = EncodeDone | GenerateError | ControlAck
