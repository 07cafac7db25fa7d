"""Decoding an image's bytes with Pillow, within the pixels limit: the size, RGB pixels and hash.

Only PNG, JPEG, GIF and WebP decoders are tried (Pillow's others parse formats no client sends an
API). Pillow's decompression-bomb guard is set to the pixels limit and its warning made an error, so
that a small file declaring a huge image is refused from its header, before any pixel is decoded.
"""

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from workers.text.image_hash import image_content_hash

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")


class DecodeRefused(Exception):
    """Bytes that are not an acceptable image: the message says why, for the client."""


@dataclass(frozen=True, slots=True)
class DecodedImage:
    width: int
    height: int
    format: str  # Pillow's name: "PNG", "JPEG", ...
    content_hash: bytes  # workers.text.image_hash's: what the encoder and the KV block keys use


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Raises DecodeRefused for non-image data, other formats, truncated files and more than `max_pixels`.
    Sets Pillow's global guard: every caller in a process passes the same limit (the settings')."""
    Image.MAX_IMAGE_PIXELS = max_pixels
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
                # Again by hand: warnings filters are process-wide, and a gateway thread's
                # catch_warnings may restore another's while this one opens its image.
                if width * height > max_pixels:
                    raise Image.DecompressionBombError(f"{width}x{height}")
                image_format = image.format or "unknown"
                image.load()  # decodes every pixel: a truncated file fails here
        except Image.UnidentifiedImageError:
            raise DecodeRefused(f"is not a {', '.join(FORMATS[:-1])} or {FORMATS[-1]} image") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise DecodeRefused(
                f"has more than {max_pixels} pixels (its header says so: nothing was decoded)"
            ) from None
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise DecodeRefused(f"could not be decoded: it is truncated or corrupt ({error})") from None
    return DecodedImage(width, height, image_format, image_content_hash(image))
