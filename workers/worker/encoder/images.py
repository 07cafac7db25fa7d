"""An EncodeRequest's images, decoded and checked before any of them is encoded: Pillow within the
request's pixel bound (a decompression bomb is refused from its header, before any pixel is
decoded), the content hash the gateway sent against the decoded pixels', and the patches and
placeholder tokens it counted against this encoder's own layout of the image. Each refusal is an
InvalidRequestError naming the field (`images[2].data`).

The gateway decoded each image once already (recipe.images.decode): these are the same rules, kept
here because a worker must not trust what crosses its socket, and workers do not import the recipe.
"""

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from PIL import Image

from workers.protocol.encode import EncodeImage
from workers.protocol.errors import InvalidRequestError
from workers.text.idefics3_images import ImageLayout, ImageSettings, image_layout
from workers.text.image_hash import image_content_hash

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CheckedImage:
    image: Image.Image  # decoded, as the preprocessing takes it
    layout: ImageLayout
    content_hash: bytes
    num_patches: int
    num_tokens: int


def check_image(
    encoded: EncodeImage, field: str, *, max_pixels: int, settings: ImageSettings, patches_per_tile: int
) -> CheckedImage:
    image = decode_image(encoded.data, field, max_pixels)
    content_hash = image_content_hash(image)
    if content_hash != encoded.content_hash:
        raise InvalidRequestError(
            f"{field}.content_hash: {encoded.content_hash.hex()[:16]}... is not the hash of the image's pixels "
            f"({content_hash.hex()[:16]}...)"
        )
    layout = image_layout(image.height, image.width, settings)
    num_tokens = layout.num_tiles * settings.image_seq_len
    num_patches = layout.num_tiles * patches_per_tile
    for name, counted, own in (
        ("num_tokens", encoded.num_tokens, num_tokens),
        ("num_patches", encoded.num_patches, num_patches),
    ):
        if counted != own:
            raise InvalidRequestError(
                f"{field}.{name}: the encoder lays this {image.width}x{image.height} image out as "
                f"{layout.num_tiles} tiles, {own} {name.removeprefix('num_')}; the request says {counted}"
            )
    return CheckedImage(image, layout, content_hash, num_patches, num_tokens)


def decode_image(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """The image in `data`, every pixel decoded; InvalidRequestError naming `field`.data otherwise."""
    image = _decoding(field, lambda: Image.open(io.BytesIO(data), formats=FORMATS))
    width, height = image.size  # from the header: no pixel is decoded yet
    if width * height > max_pixels:
        raise InvalidRequestError(
            f"{field}.data: a {width}x{height} image has more than max_pixels ({max_pixels}) pixels"
        )
    _decoding(field, image.load)  # decodes every pixel: a truncated file fails here
    return image


def _decoding(field: str, step: Callable[[], T]) -> T:
    try:
        return step()
    except Image.UnidentifiedImageError:
        raise InvalidRequestError(f"{field}.data: not a {', '.join(FORMATS)} image") from None
    except Image.DecompressionBombError:
        raise InvalidRequestError(f"{field}.data: more pixels than Pillow decodes (a decompression bomb)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise InvalidRequestError(f"{field}.data: cannot be decoded, truncated or corrupt ({error})") from None
