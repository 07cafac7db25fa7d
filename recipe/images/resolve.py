"""A request's images, read, fetched and decoded within its limits: what a vision encoder takes.

    images = resolve_images("chat.completions", body, limits)   # raises ApiError naming the field

Runs where the request is prepared (controlplane.gateway.preparation sends bodies with images to
its prepare processes): fetching and decoding hold that worker, never the gateway's event loop.
"""

import base64
import binascii
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from recipe.errors import ApiError, invalid_request
from recipe.images.decode import DecodeRefused, decode_image
from recipe.images.destinations import address_filter
from recipe.images.fetch import AddressFilter, FetchRefused, fetch_image
from recipe.images.parts import DataImage, ImagePart, image_parts
from recipe.limits import RequestLimits


@dataclass(frozen=True, slots=True)
class RequestImage:
    """One image of a request, in prompt order."""

    field: str  # where it is in the request, e.g. `messages[0].content[1].image_url`
    detail: Literal["auto", "low", "high"]
    width: int  # decoded, in pixels
    height: int
    data: bytes = field(
        repr=False
    )  # the encoded file as sent or fetched (smaller than its pixels, to pass between processes)
    content_hash: bytes  # recipe.images.decode.DecodedImage.content_hash: of the pixels


def resolve_images(
    protocol: str, body: Mapping, limits: RequestLimits, *, is_allowed: AddressFilter | None = None
) -> tuple[RequestImage, ...]:
    """The body's images; `is_allowed` is the fetch's address rule (tests swap it), by default public
    addresses and the limits' allowed networks."""
    is_allowed = is_allowed or address_filter(limits.image_fetch_allowed_networks)
    parts = image_parts(protocol, body)
    if len(parts) > limits.max_images:
        field = parts[limits.max_images].field
        raise invalid_request(
            f"`{field}`: the request has {len(parts)} images; at most {limits.max_images} are allowed", field
        )
    return tuple(_resolved(part, limits, is_allowed) for part in parts)


def _resolved(part: ImagePart, limits: RequestLimits, is_allowed: AddressFilter) -> RequestImage:
    if isinstance(part.source, DataImage):
        data = _decoded_payload(part, limits.max_image_bytes)
    else:
        try:
            data = fetch_image(
                part.source.url,
                max_bytes=limits.max_image_bytes,
                timeout_s=limits.image_fetch_timeout_s,
                is_allowed=is_allowed,
            ).data
        except FetchRefused as refusal:
            raise invalid_request(f"`{part.field}`: the image URL was not fetched: {refusal}", part.field) from None
    try:
        decoded = decode_image(data, limits.max_image_pixels)
    except DecodeRefused as refusal:
        raise invalid_request(f"`{part.field}`: the image {refusal}", part.field) from None
    return RequestImage(part.field, part.detail, decoded.width, decoded.height, data, decoded.content_hash)


def _decoded_payload(part: ImagePart, max_bytes: int) -> bytes:
    source = part.source
    assert isinstance(source, DataImage)
    # Base64 is 4 characters per 3 bytes: a payload this long is refused before it is decoded.
    if (len(source.payload) if not source.is_base64 else len(source.payload) // 4 * 3) > max_bytes + 3:
        raise _too_large(part, max_bytes)
    try:
        data = (
            base64.b64decode(source.payload, validate=True)
            if source.is_base64
            else urllib.parse.unquote_to_bytes(source.payload)
        )
    except (binascii.Error, ValueError):
        raise invalid_request(f"`{part.field}`: the image data is not valid base64", part.field) from None
    if len(data) > max_bytes:
        raise _too_large(part, max_bytes)
    return data


def _too_large(part: ImagePart, max_bytes: int) -> ApiError:
    return invalid_request(
        f"`{part.field}`: the image is more than {max_bytes} bytes; at most {max_bytes} are allowed", part.field
    )
