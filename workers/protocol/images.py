"""ImageEmbeddings: one image of a request as its encoder's output, ready for a prefill.

A vision-language model's prompt holds, per image, placeholder tokens (the model's image token) that
the image's embeddings replace before the first layer. The embeddings travel as raw bytes with
their dtype name and shape, so that an encode worker can send them to a prefill worker as raw
frames; the content hash (e.g. sha256 of the decoded pixels, computed where the image is decoded)
enters the KV block keys, so identical images in identical positions share cached KV and different
images never do. Torch-free: it crosses process boundaries as msgpack inside an EngineRequest.

`check_images` is the boundary's check against a model (its image token and hidden size) and a
prompt; the engine calls it when a request comes in.
"""

from collections.abc import Sequence

import msgspec

from workers.protocol.errors import InvalidRequestError

# Element sizes of the dtypes embeddings may arrive in; the engine casts them to the model's dtype.
EMBEDDING_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MIN_CONTENT_HASH_BYTES = 16
MAX_CONTENT_HASH_BYTES = 64


class ImageEmbeddings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One image: `num_tokens` placeholders of the prompt, in order after the previous image's, take
    the rows of `data`, a C-ordered [num_tokens, hidden_size] array of `dtype`."""

    content_hash: bytes
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def check_images(
    images: Sequence[ImageEmbeddings], prompt: Sequence[int], *, image_token_id: int | None, hidden_size: int
) -> None:
    """InvalidRequestError naming the field when the images do not fit the model and the prompt:
    `image_token_id` None means a text-only model, which takes no images."""
    if image_token_id is None:
        if images:
            raise InvalidRequestError("images: this model takes no images (it is a text-only model)")
        return
    for index, image in enumerate(images):
        _check_image(image, f"images[{index}]", hidden_size)
    placeholders = sum(1 for token in prompt if token == image_token_id)
    filled = sum(image.num_tokens for image in images)
    if placeholders != filled:
        raise InvalidRequestError(
            f"images: the prompt has {placeholders} image placeholder tokens (id {image_token_id}) but "
            f"the images' num_tokens add up to {filled}"
        )


def _check_image(image: ImageEmbeddings, name: str, hidden_size: int) -> None:
    if not isinstance(image, ImageEmbeddings):
        raise InvalidRequestError(f"{name} must be ImageEmbeddings, got {type(image).__name__}")
    if not isinstance(image.content_hash, bytes) or not (
        MIN_CONTENT_HASH_BYTES <= len(image.content_hash) <= MAX_CONTENT_HASH_BYTES
    ):
        raise InvalidRequestError(
            f"{name}.content_hash must be {MIN_CONTENT_HASH_BYTES} to {MAX_CONTENT_HASH_BYTES} bytes, "
            f"got {image.content_hash!r:.40}"
        )
    if isinstance(image.num_tokens, bool) or not isinstance(image.num_tokens, int) or image.num_tokens <= 0:
        raise InvalidRequestError(f"{name}.num_tokens must be a positive integer, got {image.num_tokens!r}")
    element = EMBEDDING_DTYPE_BYTES.get(image.dtype)
    if element is None:
        raise InvalidRequestError(
            f"{name}.dtype must be one of {', '.join(EMBEDDING_DTYPE_BYTES)}, got {image.dtype!r}"
        )
    expected_shape = (image.num_tokens, hidden_size)
    if tuple(image.shape) != expected_shape:
        raise InvalidRequestError(
            f"{name}.shape must be [num_tokens, hidden_size] = {list(expected_shape)}, got {list(image.shape)}"
        )
    expected_bytes = image.num_tokens * hidden_size * element
    if not isinstance(image.data, bytes) or len(image.data) != expected_bytes:
        raise InvalidRequestError(
            f"{name}.data must be {expected_bytes} bytes ({image.num_tokens} x {hidden_size} {image.dtype}), "
            f"got {len(image.data) if isinstance(image.data, bytes) else type(image.data).__name__}"
        )


class ImageRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image of a GenerateRequest whose embeddings an encode worker sends the worker separately
    (ImageEmbeddingsDelivery): the request waits for them, in this order, before it is computed."""

    content_hash: bytes
    num_tokens: int


class ImageEmbeddingsDelivery(msgspec.Struct, tag="image_embeddings", frozen=True, forbid_unknown_fields=True):
    """Encode worker → the worker that computes a request's prompt (prefill or mixed), on its request
    ROUTER: image `image_index` of `num_images` of request `request_id`. The message is two frames:
    this struct, then the embeddings' raw bytes, a C-ordered `shape` array of `dtype` (never pickled).
    The receiver checks them as ImageEmbeddings (check_images) once the request's images are all there."""

    request_id: str
    image_index: int
    num_images: int
    content_hash: bytes
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
