"""A tiny random Idefics3 saved as a Hugging Face directory (tiles of 32 px, 16 patches and 4
embeddings each, images up to 64 px long: 2 x 2 tiles and the global one), and pictures for it."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from tests.workers.engine.hf_idefics3_reference import build_hf_idefics3
from workers.text.idefics3_images import ImageSettings

SETTINGS = ImageSettings(longest_edge=64, tile_side=32, image_seq_len=4)
PATCHES_PER_TILE = 16
PREPROCESSOR = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}


@pytest.fixture(scope="package")
def hf_model():
    return build_hf_idefics3()


@pytest.fixture(scope="package")
def model_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    hf_model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def picture(width: int, height: int, seed: int, channels: int = 3) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
