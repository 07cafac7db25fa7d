"""An image's content hash: what the gateway records for an image input and what the engine mixes into
the keys of the KV blocks from the image on, so one picture has one hash however it arrived."""

from hashlib import sha256

from PIL import Image


def image_content_hash(image: Image.Image) -> bytes:
    """sha256 of the size and the RGB pixels, not of a file: the same picture has one hash whether it
    came by data URL, base64 block or URL, or was re-encoded without loss, and the hash covers exactly
    what an encoder sees."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.digest()
