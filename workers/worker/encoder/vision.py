"""The encode worker's model: an Idefics3 / SmolVLM vision tower and connector
(workers.engine.models.idefics3.Idefics3VisionEncoder) and the model's image preprocessing.

From a Hugging Face directory only the vision and connector tensors are read (a 2B model's text
weights are never loaded). From a config (random weights) the whole model is drawn from the seed and
its vision part kept, so that an encoder and a prefill worker built from one config and seed hold the
same vision weights.
"""

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from workers.args import EngineArgs
from workers.engine.dtypes import torch_dtype
from workers.engine.image_inputs import image_settings
from workers.engine.model_loader import load_model
from workers.engine.models.idefics3 import (
    CONNECTOR_PREFIX,
    VISION_PREFIX,
    Idefics3,
    Idefics3ForConditionalGeneration,
    Idefics3VisionEncoder,
)
from workers.engine.models.registry import family_of
from workers.engine.weights import ModelFiles, resolve_model
from workers.protocol.errors import ModelLoadError
from workers.text.idefics3_images import ImageSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VisionModel:
    name: str  # the model's served name, as an engine worker of the same model reports it
    encoder: Idefics3VisionEncoder
    settings: ImageSettings

    @property
    def device(self) -> torch.device:
        return self.encoder.connector.modality_projection.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.connector.modality_projection.proj.weight.dtype

    @property
    def patches_per_tile(self) -> int:
        return self.encoder.config.vision.patches_per_side**2

    @property
    def tokens_per_tile(self) -> int:
        """Embeddings (prompt placeholders) per tile."""
        return self.encoder.config.image_seq_len

    @torch.inference_mode()
    def encode(self, pixels: np.ndarray) -> torch.Tensor:
        """[tiles, 3, side, side] float32 pixel values → [tiles · tokens_per_tile, text hidden] on the CPU."""
        return self.encoder(torch.from_numpy(pixels).to(self.device)).cpu()


def load_vision_model(args: EngineArgs) -> VisionModel:
    """The vision tower and connector of `args.model` on `args.device`, in `args.dtype` (float32 on
    the CPU, bfloat16 on CUDA by default); ModelLoadError for a model that is not an Idefics3."""
    device = torch.device(args.device)
    dtype = torch_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    files = _weighted_files(args.model)
    if files is None:
        name, encoder = _random_vision_encoder(args, device, dtype)
    else:
        name, encoder = files.name, _loaded_vision_encoder(files, device, dtype)
    encoder.eval()
    # image_settings reads the model's config only, which the vision encoder carries.
    settings = image_settings(encoder, args.model)
    if settings.tile_side != encoder.config.vision.image_size:
        raise ModelLoadError(
            f"preprocessor_config.json: max_image_size.longest_edge ({settings.tile_side}) must be the vision "
            f"tower's tile side, vision_config.image_size ({encoder.config.vision.image_size})"
        )
    log.info("vision encoder of %s on %s (%s): tiles of %d px", name, device, dtype, settings.tile_side)
    return VisionModel(name=name, encoder=encoder, settings=settings)


def _weighted_files(source: str | os.PathLike | dict) -> ModelFiles | None:
    """The model's files when it has weights; None for a config (a dict, a JSON file, a directory
    with config.json alone)."""
    if isinstance(source, dict) or Path(source).is_file():
        return None
    files = resolve_model(source)
    return files if files.weight_files else None


def _idefics3(hf: dict) -> Idefics3:
    family = family_of(hf)
    if not isinstance(family, Idefics3):
        raise ModelLoadError(
            f"an encode worker serves a vision-language model (Idefics3 / SmolVLM); this one is {family.name}"
        )
    return family


def _random_vision_encoder(
    args: EngineArgs, device: torch.device, dtype: torch.dtype
) -> tuple[str, Idefics3VisionEncoder]:
    loaded = load_model(args.model, device=device, dtype=dtype, seed=args.seed, max_model_len=None)
    if not isinstance(loaded.model, Idefics3ForConditionalGeneration):
        raise ModelLoadError(
            f"an encode worker serves a vision-language model (Idefics3 / SmolVLM); {loaded.name} is not one"
        )
    return loaded.name, loaded.model.vision


def _loaded_vision_encoder(files: ModelFiles, device: torch.device, dtype: torch.dtype) -> Idefics3VisionEncoder:
    config = _idefics3(files.config).model_config(files.config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = Idefics3VisionEncoder(config)
    finally:
        torch.set_default_dtype(previous)
    encoder.load_weights(_vision_tensors(files))
    return encoder


def _vision_tensors(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower's and connector's tensors, read alone from the weight files."""
    for path in files.weight_files:
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if name.startswith((VISION_PREFIX, CONNECTOR_PREFIX)):
                        yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{path}: unreadable safetensors file (truncated or corrupt): {error}") from error
