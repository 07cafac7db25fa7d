"""Image files and request bodies for the image tests: real PNGs made with Pillow, and hostile ones."""

import base64
import io
import random
import struct
import zlib

from PIL import Image

from tests.controlplane.gateway.helpers import valid_body


def png(width: int = 8, height: int = 6, *, seed: int = 0, compress_level: int = 6) -> bytes:
    """A PNG of random pixels: different seeds, different pictures."""
    pixels = random.Random(seed).randbytes(width * height * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buffer, "PNG", compress_level=compress_level)
    return buffer.getvalue()


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header declaring `width` x `height` pixels, with almost no data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack("!I", len(data)) + kind + data + struct.pack("!I", zlib.crc32(kind + data))

    header = struct.pack("!IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def truncated_png() -> bytes:
    whole = png(64, 64, seed=3)
    return whole[: len(whole) // 2]


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(protocol: str, url: str) -> dict:
    """The protocol's image part for a data URL or an http(s) URL."""
    if protocol == "chat.completions":
        return {"type": "image_url", "image_url": {"url": url}}
    if protocol == "responses":
        return {"type": "input_image", "image_url": url}
    if url.startswith("data:"):
        media_type, _, payload = url[len("data:") :].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": payload}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def text_part(protocol: str, text: str) -> dict:
    return {"type": "input_text" if protocol == "responses" else "text", "text": text}


def body_with_images(protocol: str, *urls: str) -> dict:
    """A valid body whose one user message holds `urls` as image parts, after a text part."""
    wire = "messages" if protocol == "messages.count_tokens" else protocol
    content = [text_part(wire, "What is in these?"), *(image_part(wire, url) for url in urls)]
    message = [{"role": "user", "content": content}]
    if protocol == "responses":
        return valid_body(protocol, input=message)
    return valid_body(protocol, messages=message)


def image_field(protocol: str, index: int) -> str:
    """The field a refusal of the body_with_images image at `index` names."""
    part = f"content[{index + 1}]"
    return {
        "chat.completions": f"messages[0].{part}.image_url.url",
        "responses": f"input[0].{part}.image_url",
    }.get(protocol, f"messages[0].{part}.source")
