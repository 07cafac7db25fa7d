"""The offline engine's images: Pillow images of a prompt → its expanded placeholders and its
ImageEmbeddings, encoded in-process by the model's own vision encoder.

What a serving stack splits over processes (the gateway preprocesses and counts, an encode worker
encodes, the prefill injects) happens here in one: preprocessing and the placeholder layout are
workers.text.idefics3_images', the same the gateway uses, so the offline engine's tokens for a
prompt are what a serving stack should give for it.
"""

import json
import os
from pathlib import Path

import torch
from PIL import Image

from workers.engine.models.idefics3 import Idefics3ForConditionalGeneration
from workers.protocol.errors import InvalidRequestError
from workers.protocol.images import ImageEmbeddings
from workers.text.idefics3_images import ImageLayout, ImageSettings, preprocess_image
from workers.text.image_hash import image_content_hash

# A whole image's longest edge, in tiles, when the model comes with no preprocessor config (SmolVLM's).
DEFAULT_TILES_PER_EDGE = 4


def image_settings(model: Idefics3ForConditionalGeneration, source: object) -> ImageSettings:
    """The preprocessing of a model: its directory's preprocessor_config.json, or, for a model without
    one (a config of random weights), tiles of its vision tower's side and images up to
    DEFAULT_TILES_PER_EDGE tiles long."""
    config = model.config
    path = Path(source) / "preprocessor_config.json" if isinstance(source, str | os.PathLike) else None
    if path is not None and path.is_file():
        return ImageSettings.from_hf(json.loads(path.read_text()), config.image_seq_len)
    side = config.vision.image_size
    return ImageSettings(longest_edge=DEFAULT_TILES_PER_EDGE * side, tile_side=side, image_seq_len=config.image_seq_len)


class ImageEncoder:
    """Encodes a prompt's images with the model's vision encoder, on the model's device."""

    def __init__(self, model: Idefics3ForConditionalGeneration, settings: ImageSettings) -> None:
        self.model = model
        self.settings = settings
        self.device = model.embed_tokens.weight.device

    @torch.inference_mode()
    def encode(self, image: Image.Image) -> tuple[ImageLayout, ImageEmbeddings]:
        """The image's layout (how its placeholder expands) and its embeddings message."""
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"images must be PIL images, got {type(image).__name__}")
        pixels, layout = preprocess_image(image, self.settings)
        embeddings = self.model.encode_images(torch.from_numpy(pixels).to(self.device)).contiguous().cpu()
        message = ImageEmbeddings(
            content_hash=image_content_hash(image),
            num_tokens=embeddings.shape[0],
            dtype=str(embeddings.dtype).removeprefix("torch."),
            shape=tuple(embeddings.shape),
            data=embeddings.view(torch.uint8).numpy().tobytes(),
        )
        return layout, message
