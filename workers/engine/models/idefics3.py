"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration: one
architecture under two names): a SigLIP vision tower and a pixel-shuffle connector turn each image
tile into `image_seq_len` embeddings, which replace the embeddings of the prompt's image
placeholder tokens (config.image_token_id) before a Llama decoder.

The seam between an image encoder and a prefill:
- `Idefics3VisionEncoder.forward(pixel_values)`: the processor's tiles of one or more images
  ([tiles, 3, side, side], workers.text.idefics3_images) → [tiles · image_seq_len, text hidden]
  embeddings, in the order of the prompt's placeholders. An encode worker builds only this module
  (`Idefics3VisionEncoder.from_config`) and loads only the vision tensors.
- `image_placeholder_rows(input_ids, image_token_id)` and `InjectedEmbeddings`: a prefill chunk
  passes the embeddings of the placeholders it holds, in order, to the decoder's forward, which
  writes them over the token embeddings; everything else (paged KV, chunking) is the text path.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from workers.engine.config import ModelConfig
from workers.engine.models.decoder import DecoderForCausalLM, InjectedEmbeddings, copy_checkpoint_tensor
from workers.engine.models.family import DecoderFamily
from workers.engine.models.vision.connector import PixelShuffleConnector
from workers.engine.models.vision.siglip import SiglipVisionTransformer, VisionConfig
from workers.engine.weights.quantization import BlockQuantized
from workers.protocol.errors import ModelLoadError

# HF's Idefics3VisionConfig defaults, for fields a checkpoint's vision_config leaves out.
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# HF's Idefics3Config defaults: its text model is Llama with this norm epsilon unless said otherwise.
TEXT_DEFAULTS = {"rms_norm_eps": 1e-5}
DEFAULT_IMAGE_TOKEN_ID = 128257
DEFAULT_SCALE_FACTOR = 2
# HF's activation names → torch's GELU approximation.
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
VISION_PREFIX = "model.vision_model."
CONNECTOR_PREFIX = "model.connector."
TEXT_PREFIX = "model.text_model."


@dataclass(frozen=True, slots=True)
class Idefics3Config(ModelConfig):
    """The text decoder's shape (the ModelConfig fields) with the vision side."""

    vision: VisionConfig = field(kw_only=True)
    scale_factor: int = field(kw_only=True)  # the connector's pixel shuffle: scale² patches per embedding
    image_token_id: int = field(kw_only=True)  # the placeholder token an image embedding replaces

    @property
    def image_seq_len(self) -> int:
        """Embeddings per tile (and placeholders per tile in the prompt)."""
        return (self.vision.patches_per_side // self.scale_factor) ** 2


class Idefics3VisionEncoder(nn.Module):
    """The vision tower and the connector: what an encode worker runs."""

    def __init__(self, config: Idefics3Config) -> None:
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionTransformer(config.vision)
        self.connector = PixelShuffleConnector(config.vision.hidden_size, config.hidden_size, config.scale_factor)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, side, side] normalized pixels → [tiles · image_seq_len, text hidden]."""
        vision = self.config.vision
        expected = (vision.num_channels, vision.image_size, vision.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values must be [tiles, {', '.join(map(str, expected))}], got {tuple(pixel_values.shape)}"
            )
        dtype = self.connector.modality_projection.proj.weight.dtype
        embeddings = self.connector(self.vision_model(pixel_values.to(dtype)))
        return embeddings.reshape(-1, embeddings.shape[-1])

    def expected_hf_names(self) -> set[str]:
        return {_hf_vision_name(name) for name in self.state_dict()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named vision and connector tensors (model.vision_model.*, model.connector.*); every
        parameter must be covered and nothing else given."""
        params = self.state_dict()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = _our_vision_name(hf_name)
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in this model")
            copy_checkpoint_tensor(params[name], tensor, hf_name)
            loaded.add(hf_name)
        missing = sorted(self.expected_hf_names() - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")


class Idefics3ForConditionalGeneration(DecoderForCausalLM):
    """The Llama decoder (the text path, unchanged) with the vision encoder beside it."""

    config: Idefics3Config

    def __init__(self, config: Idefics3Config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.vision = Idefics3VisionEncoder(config)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Idefics3VisionEncoder.forward, for a process that holds the whole model."""
        return self.vision(pixel_values)

    def init_random_weights(self, seed: int) -> None:
        super().init_random_weights(seed)
        with torch.no_grad():
            for module in self.vision.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockQuantized]]) -> None:
        """HF names: model.text_model.* and lm_head.weight go to the decoder, model.vision_model.*
        and model.connector.* to the vision encoder; any other name is refused."""
        vision: list[tuple[str, torch.Tensor]] = []
        super().load_weights(self._text_weights(weights, vision))
        self.vision.load_weights(vision)

    @staticmethod
    def _text_weights(
        weights: Iterable[tuple[str, Any]], vision: list[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, Any]]:
        """The decoder's tensors under the names DecoderForCausalLM reads (and checks for
        completeness: its expected_hf_names are in those names); vision ones set aside."""
        for hf_name, tensor in weights:
            if hf_name.startswith((VISION_PREFIX, CONNECTOR_PREFIX)):
                vision.append((hf_name, tensor))
            elif hf_name.startswith(TEXT_PREFIX):
                yield "model." + hf_name.removeprefix(TEXT_PREFIX), tensor
            elif hf_name == "lm_head.weight":
                yield hf_name, tensor
            else:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in this model")


def image_placeholder_rows(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """The rows of a step's flattened tokens that hold image placeholders, in order."""
    return torch.nonzero(input_ids == image_token_id).flatten()


def inject_image_embeddings(
    input_ids: torch.Tensor, image_token_id: int, embeddings: torch.Tensor
) -> InjectedEmbeddings:
    """InjectedEmbeddings that put `embeddings`, one per placeholder in order, at a step's image
    placeholders; refuses a count that does not match."""
    rows = image_placeholder_rows(input_ids, image_token_id)
    if rows.numel() != embeddings.shape[0]:
        raise ValueError(f"{rows.numel()} image placeholders in the tokens but {embeddings.shape[0]} image embeddings")
    return InjectedEmbeddings(rows=rows, embeddings=embeddings)


class Idefics3(DecoderFamily):
    name = "idefics3"
    model_class = Idefics3ForConditionalGeneration

    def model_config(self, hf: dict[str, Any]) -> Idefics3Config:
        text = {**TEXT_DEFAULTS, **_sub_config(hf, "text_config")}
        text_type = text.get("model_type", "llama")
        if text_type != "llama":
            raise ModelLoadError(f"unsupported text_config.model_type {text_type!r}; supported: 'llama'")
        # The tie and the dtype are the whole model's settings.
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
        text["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or text.get("torch_dtype") or text.get("dtype")
        base = super().model_config(text)
        vision = _vision_config({**VISION_DEFAULTS, **_sub_config(hf, "vision_config")})
        scale = _positive_int(hf, "scale_factor", DEFAULT_SCALE_FACTOR)
        if vision.patches_per_side % scale:
            raise ModelLoadError(
                f"scale_factor ({scale}) must divide the patches per side "
                f"(vision_config.image_size // patch_size = {vision.patches_per_side})"
            )
        image_token_id = hf.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)
        if isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
            raise ModelLoadError(f"image_token_id must be an integer, got {image_token_id!r}")
        if not 0 <= image_token_id < base.vocab_size:
            raise ModelLoadError(f"image_token_id ({image_token_id}) is outside the vocabulary ({base.vocab_size})")
        return Idefics3Config(
            **{shared.name: getattr(base, shared.name) for shared in fields(ModelConfig)},
            vision=vision,
            scale_factor=scale,
            image_token_id=image_token_id,
        )


def _vision_config(hf: dict[str, Any]) -> VisionConfig:
    act = hf["hidden_act"]
    if act not in GELU_APPROXIMATIONS:
        raise ModelLoadError(
            f"unsupported vision_config.hidden_act {act!r}; supported: {', '.join(GELU_APPROXIMATIONS)}"
        )
    config = VisionConfig(
        hidden_size=_positive_int(hf, "hidden_size", None, "vision_config."),
        intermediate_size=_positive_int(hf, "intermediate_size", None, "vision_config."),
        num_layers=_positive_int(hf, "num_hidden_layers", None, "vision_config."),
        num_heads=_positive_int(hf, "num_attention_heads", None, "vision_config."),
        num_channels=_positive_int(hf, "num_channels", None, "vision_config."),
        image_size=_square_side(hf, "image_size"),
        patch_size=_square_side(hf, "patch_size"),
        layer_norm_eps=float(hf["layer_norm_eps"]),
        gelu_approximation=GELU_APPROXIMATIONS[act],
    )
    if config.hidden_size % config.num_heads:
        raise ModelLoadError(
            f"vision_config.hidden_size ({config.hidden_size}) is not a multiple of "
            f"vision_config.num_attention_heads ({config.num_heads})"
        )
    if config.patch_size > config.image_size:
        raise ModelLoadError(
            f"vision_config.patch_size ({config.patch_size}) is larger than "
            f"vision_config.image_size ({config.image_size})"
        )
    return config


def _sub_config(hf: dict[str, Any], name: str) -> dict[str, Any]:
    sub = hf.get(name) or {}
    if not isinstance(sub, dict):
        raise ModelLoadError(f"{name} must be an object, got {sub!r}")
    return sub


def _square_side(hf: dict[str, Any], name: str) -> int:
    """A side in pixels; HF allows [height, width], served only when square."""
    value = hf[name]
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise ModelLoadError(f"vision_config.{name} must be square, got {value!r}")
        value = value[0]
    return _positive_int({name: value}, name, None, "vision_config.")


def _positive_int(hf: dict[str, Any], name: str, default: int | None, prefix: str = "") -> int:
    value = hf.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{prefix}{name} must be a positive integer, got {value!r}")
    return value


def _our_vision_name(hf_name: str) -> str:
    if hf_name.startswith(VISION_PREFIX):
        return "vision_model." + hf_name.removeprefix(VISION_PREFIX)
    return "connector." + hf_name.removeprefix(CONNECTOR_PREFIX)


def _hf_vision_name(name: str) -> str:
    if name.startswith("vision_model."):
        return VISION_PREFIX + name.removeprefix("vision_model.")
    return CONNECTOR_PREFIX + name.removeprefix("connector.")
