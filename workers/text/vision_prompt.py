"""How a served vision-language model (Idefics3 / SmolVLM) takes images in its prompts, read from its
directory without loading it: its image token, its preprocessing (workers.text.idefics3_images) and
the vision-tower patches of a tile. The gateway counts each image's placeholder tokens and patches
with it, from the image's size alone.

Fields a config.json leaves out take HF Idefics3Config's defaults, the ones the engine's loader
(workers.engine.models.idefics3) takes too (a test holds the two to each other). A model served
with images needs its preprocessor_config.json: without it the engine's offline default would apply,
which a gateway does not guess.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from workers.protocol.errors import ModelLoadError
from workers.text.idefics3_images import ImageLayout, ImageSettings, image_layout

VISION_ARCHITECTURES = frozenset({"Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"})
PREPROCESSOR_FILE = "preprocessor_config.json"
DEFAULT_IMAGE_TOKEN_ID = 128257
DEFAULT_SCALE_FACTOR = 2
DEFAULT_IMAGE_SIZE = 224  # vision_config.image_size: a tile's side
DEFAULT_PATCH_SIZE = 32  # vision_config.patch_size


@dataclass(frozen=True, slots=True)
class VisionPrompt:
    image_token_id: int  # the placeholder each image embedding replaces
    settings: ImageSettings
    patches_per_tile: int  # (tile side / patch size)²: what the vision tower runs per tile

    def layout(self, height: int, width: int) -> ImageLayout:
        return image_layout(height, width, self.settings)

    def num_tokens(self, layout: ImageLayout) -> int:
        """The image's placeholder tokens: one per embedding, image_seq_len per tile."""
        return layout.num_tiles * self.settings.image_seq_len

    def num_patches(self, layout: ImageLayout) -> int:
        return layout.num_tiles * self.patches_per_tile


def read_vision_prompt(directory: Path, config: Mapping) -> VisionPrompt | None:
    """None for a model that takes no images (its architecture is not a vision-language one)."""
    if not VISION_ARCHITECTURES.intersection(config.get("architectures") or ()):
        return None
    vision = config.get("vision_config") or {}
    image_size = _positive_int(vision, "image_size", DEFAULT_IMAGE_SIZE, "vision_config.")
    patch_size = _positive_int(vision, "patch_size", DEFAULT_PATCH_SIZE, "vision_config.")
    scale = _positive_int(config, "scale_factor", DEFAULT_SCALE_FACTOR)
    # A tile's last image_size % patch_size pixels are read by no patch (SmolVLM-Instruct: 384 / 14).
    patches_per_side = image_size // patch_size
    if not patches_per_side or patches_per_side % scale:
        raise ModelLoadError(
            f"vision_config.image_size // patch_size ({image_size} // {patch_size}) must be a positive "
            f"multiple of scale_factor ({scale})"
        )
    path = Path(directory) / PREPROCESSOR_FILE
    try:
        preprocessor = json.loads(path.read_text(encoding="utf-8"))
        settings = ImageSettings.from_hf(preprocessor, image_seq_len=(patches_per_side // scale) ** 2)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{path}: a vision-language model is served with its preprocessor config: {error}"
        ) from None
    if settings.tile_side != image_size:
        raise ModelLoadError(
            f"{path}: max_image_size.longest_edge ({settings.tile_side}) must be the vision tower's "
            f"image_size ({image_size})"
        )
    return VisionPrompt(
        image_token_id=_positive_int(config, "image_token_id", DEFAULT_IMAGE_TOKEN_ID, low=0),
        settings=settings,
        patches_per_tile=patches_per_side**2,
    )


def _positive_int(values: Mapping, name: str, default: int, prefix: str = "", *, low: int = 1) -> int:
    value = values.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelLoadError(f"{prefix}{name} must be an integer of at least {low}, got {value!r}")
    return value
