"""SigLIP's vision transformer as Idefics3 / SmolVLM use it: a strided convolution cuts a square
tile into patches, a learned position embedding per patch, pre-norm encoder layers (LayerNorm,
bidirectional attention with biases, a GELU MLP) and a final LayerNorm. Tiles come whole (the image
processor never pads inside one), so every patch attends to every other one."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # a tile's side, in pixels
    patch_size: int  # a patch's side, in pixels
    layer_norm_eps: float
    gelu_approximation: str  # torch's name: "tanh" or "none"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def patch_position_ids(patches_per_side: int) -> torch.Tensor:
    """The position-embedding row of each patch of a whole tile, row-major. HF buckets each patch's
    fractional coordinate (index / patches per side) into the table's grid in float32; for some
    sides (19, 25...) rounding moves a patch to its neighbour's row, and the checkpoints were trained
    with that, so it is kept rather than taken as plain indices."""
    side = patches_per_side
    # float32 whatever the default dtype (models are built under their serving dtype).
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)
    step = 1.0 / torch.tensor(side, dtype=torch.float32)
    coords = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)
        self.patches_per_side = config.patches_per_side
        self.init_buffers()

    def init_buffers(self) -> None:
        """The patches' position ids, on the default device: at construction, and again once a model built
        on meta has storage (workers.engine.materialize)."""
        self.register_buffer("position_ids", patch_position_ids(self.patches_per_side), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, side, side] pixels → [tiles, patches, hidden]."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding(self.position_ids)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        size = config.hidden_size
        self.q_proj = nn.Linear(size, size)
        self.k_proj = nn.Linear(size, size)
        self.v_proj = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tiles, patches, size = hidden.shape
        q, k, v = (
            proj(hidden).view(tiles, patches, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        attended = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(attended.transpose(1, 2).reshape(tiles, patches, size))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.approximate = config.gelu_approximation
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(hidden), approximate=self.approximate))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class SiglipVisionTransformer(nn.Module):
    """Module names follow HF's (embeddings, encoder.layers.N, post_layernorm) so that a checkpoint's
    tensors load by name."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, side, side] pixels → [tiles, patches, hidden] patch features."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))
