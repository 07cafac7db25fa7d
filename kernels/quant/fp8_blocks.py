"""FP8 block scaling in torch: the reference every FP8 kernel is checked against, and what loads use
off CUDA.

DeepSeek-V3's format: a weight [N, K] is stored as e4m3 with one float32 `weight_scale_inv` per
`block` = (block_n, block_k) tile, [ceil(N / block_n), ceil(K / block_k)]; the real weight is the e4m3
value times its tile's scale_inv. Activations are quantized dynamically, one scale per token and group
of `group` consecutive channels (1 x 128 for DeepSeek-V3).
"""

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A tile of zeros still gets a usable scale: dividing by it never makes inf or NaN.
MIN_AMAX = 1e-12


def check_block(block: tuple[int, int]) -> None:
    """A block the FP8 kernels take: their K loop steps one block_k-wide activation group at a time,
    and tl.dot takes power-of-two depths of at least 16."""
    if len(block) != 2:
        raise ValueError(f"block must be (block_n, block_k), got {block}")
    block_n, block_k = block
    if block_n < 1:
        raise ValueError(f"block's block_n must be >= 1, got {block}")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block's block_k must be a power of two >= 16, got {block}")


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [N, K] weight in (block_n, block_k) tiles."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 scale_inv per tile of a [..., N, K] weight (leading dims: experts), each
    tile scaled so its largest magnitude maps to e4m3's largest."""
    *lead, n, k = weight.shape
    rows, cols = block_grid((n, k), block)
    padded = torch.zeros(*lead, rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[..., :n, :k] = weight.float()
    tiles = padded.unflatten(-1, (cols, block[1])).unflatten(-3, (rows, block[0]))  # [..., rows, bn, cols, bk]
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=MIN_AMAX)
    scale_inv = amax / FP8_MAX
    values = (tiles / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    values = values.flatten(-2).flatten(-3, -2)[..., :n, :k].contiguous()
    return values, scale_inv.squeeze(-1).squeeze(-2).contiguous()


def dequantize_weight_blocks(
    values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The real weight of e4m3 `values` [..., N, K] and their tiles' `scale_inv`."""
    *_, n, k = values.shape
    scales = scale_inv.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]
    return (values.float() * scales).to(dtype)


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values [..., K] and float32 scales [..., ceil(K / group)] of an activation, one scale per
    token and group of `group` channels (value * scale is the activation)."""
    k = x.shape[-1]
    groups = math.ceil(k / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).unflatten(-1, (groups, group))
    amax = padded.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    # Multiplied by the correctly rounded FP8_MAX / amax, as the Triton kernels do (one division per
    # group rather than per value), so both round every value to the same e4m3. A tensor numerator:
    # `FP8_MAX / amax` would be amax's reciprocal times FP8_MAX, rounded twice.
    inverse = torch.full_like(amax, FP8_MAX) / amax
    values = (padded * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)[..., :k].contiguous()
    return values, (amax / FP8_MAX).squeeze(-1).contiguous()


def w8a8_block_matmul_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T in float32 as the W8A8 kernel computes it: x quantized per token and group of block_k
    channels, W dequantized from its tiles; the result in x's dtype."""
    return dequantized_w8a8(x, dequantize_weight_blocks(values, scale_inv, block), block[1], bias)


def dequantized_w8a8(x: torch.Tensor, weight: torch.Tensor, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T with x quantized per token and `group` channels as the W8A8 kernel does, the
    product in float32: w8a8_block_matmul_reference's op order, the weight already dequantized."""
    x_values, x_scales = quantize_activation_groups(x, group)
    x_real = x_values.float() * x_scales.repeat_interleave(group, dim=-1)[..., : x.shape[-1]]
    out = x_real @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
