"""An image's content hash: what the gateway records for an image input and what the engine mixes into
the keys of the KV blocks from the image on, so one picture has one hash however it arrived."""

from hashlib import sha256

import numpy as np
from PIL import Image


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """[height, width, 3] uint8, what a vision encoder sees: transparency is composited onto white,
    as HF's convert_to_rgb does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"))


def image_content_hash(image: Image.Image) -> bytes:
    """sha256 of the size and the RGB pixels after compositing (rgb_pixels), not of a file: the same
    picture has one hash whether it came by data URL, base64 block or URL, or was re-encoded without
    loss, and the hash covers exactly what an encoder sees (two images that differ only in alpha the
    compositing hides have one hash, and one set of embeddings)."""
    pixels = rgb_pixels(image)
    digest = sha256(f"{pixels.shape[1]}x{pixels.shape[0]}:".encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.digest()
