"""Decoding an image's bytes with Pillow, within the pixels limit: the size, RGB pixels and hash.

Only PNG, JPEG, GIF and WebP decoders are tried (Pillow's others parse formats no client sends an
API). Pillow's decompression-bomb guard is set to the pixels limit and its warning made an error, so
that a small file declaring a huge image is refused from its header, before any pixel is decoded.
"""

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")


class DecodeRefused(Exception):
    """Bytes that are not an acceptable image: the message says why, for the client."""


@dataclass(frozen=True, slots=True)
class DecodedImage:
    width: int
    height: int
    format: str  # Pillow's name: "PNG", "JPEG", ...
    # sha256 of the size and the decoded RGB pixels, not of the file: the same picture has one hash
    # whether it came by data URL, base64 block or URL, or was re-encoded without loss (PNG at another
    # compression level, other metadata), and the hash covers exactly what an encoder sees.
    content_hash: str


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
                rgb = image.convert("RGB")  # decodes every pixel: a truncated file fails here
        except Image.UnidentifiedImageError:
            raise DecodeRefused(f"is not a {', '.join(FORMATS[:-1])} or {FORMATS[-1]} image") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise DecodeRefused(
                f"has more than {max_pixels} pixels (its header says so: nothing was decoded)"
            ) from None
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise DecodeRefused(f"could not be decoded: it is truncated or corrupt ({error})") from None
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(rgb.tobytes())
    return DecodedImage(width, height, image_format, digest.hexdigest())
