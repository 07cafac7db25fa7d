import math

import torch
from torch import nn

from workers.engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, with the config's context-extension scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.kind == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): pairs that turn more than beta_fast times over the original context keep
    their frequency, those turning fewer than beta_slow times are divided by `factor`, and a linear
    ramp over the pair index blends the two in between."""
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)

    def pair_turning(rotations: float) -> float:
        # The (fractional) pair index whose wavelength fits `rotations` times in the original context.
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = pair_turning(rope.beta_fast), pair_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp needs some width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


class RotaryEmbedding(nn.Module):
    """Per-position rotation angles, precomputed; `angles` looks them up once per step for all layers.
    cos and sin carry the rope's attention factor (1 but for YaRN)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.init_buffers()

    def init_buffers(self) -> None:
        """The tables, on the default device: at construction, and again once a model built on meta has
        storage (workers.engine.materialize)."""
        rope = self.rope
        freqs = torch.outer(
            torch.arange(self.max_positions, dtype=torch.float32), inverse_frequencies(rope, self.head_dim)
        )
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", angles.cos() * rope.attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * rope.attention_factor, persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of each head ([T, heads, head_dim]) by position, in HF's rotate_half layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope layout, adjacent pairs (x0, x1), (x2, x3), ..., regrouped into halves [x0, x2,
    ..., x1, x3, ...], so apply_rotary turns each pair by its frequency. Queries and keys regrouped
    alike keep their dot products; HF's V3 writes its rotated pairs in this layout too."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
