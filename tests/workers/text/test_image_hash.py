"""The content hash covers what an encoder sees: RGB after transparency is composited onto white."""

import io

import numpy as np
from PIL import Image

from workers.text.image_hash import image_content_hash, rgb_pixels


def rgba(alpha: int, rgb=(10, 200, 30)) -> Image.Image:
    pixels = np.zeros((8, 12, 4), dtype=np.uint8)
    pixels[..., :3] = rgb
    pixels[..., 3] = alpha
    return Image.fromarray(pixels, "RGBA")


def test_images_that_differ_only_in_alpha_hash_apart_when_the_encoder_sees_them_apart():
    opaque, translucent = rgba(255), rgba(100)
    assert not np.array_equal(rgb_pixels(opaque), rgb_pixels(translucent))
    assert image_content_hash(opaque) != image_content_hash(translucent)


def test_colours_hidden_by_full_transparency_hash_alike():
    assert image_content_hash(rgba(0, (1, 2, 3))) == image_content_hash(rgba(0, (200, 100, 50)))


def test_the_same_picture_hashes_alike_from_a_file_and_from_memory():
    picture = rgba(255).convert("RGB")
    png = io.BytesIO()
    picture.save(png, format="PNG")
    assert image_content_hash(Image.open(io.BytesIO(png.getvalue()))) == image_content_hash(picture)
    assert image_content_hash(picture) != image_content_hash(picture.resize((12, 9)))
