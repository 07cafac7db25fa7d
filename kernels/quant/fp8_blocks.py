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
# Float32 values quantize_weight_blocks works through at a time, a bounded few copies of that rather
# than of a whole expert stack: on a GPU 64 MiB, kernels long enough that launching them costs little;
# elsewhere 4 MiB, which stays in a CPU's cache (2.5x faster than 64 MiB for a 4096 x 4096 weight).
CHUNK_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 20}
# Model weights quantized at load try each tile's scale at amax / 448 times each of these and keep the
# one whose rounding errs least (an "MSE observer"): one octave in 16 steps. e4m3 rounds x and 2x
# alike but near zero, so an octave offers every way of aligning a tile to the grid, and a shrunk
# scale f < 1 (which clips the tile's largest values at +-448) never errs less than 2f, which rounds
# those values instead (save the few under e4m3's smallest normal). 16 steps, not 8: the squared error
# still falls (by 0.6% on SmolLM2, 3% on heavy-tailed random weights), and with only SmolLM2's weights
# rounded (float32 compute) its perplexity depended less on where the grid falls (spread 0.007, not
# 0.02, over grids shifted per tile by a random part of a step).
SEARCHED_SCALE_FACTORS = tuple(2 ** (step / 16) for step in range(16))


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


def quantize_weight_blocks(
    weight: torch.Tensor,
    block: tuple[int, int],
    *,
    scale_factors: tuple[float, ...] = (1.0,),
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 scale_inv per tile of a [..., N, K] weight (leading dims: experts).

    Each tile's scale_inv is amax / 448 times the one of `scale_factors` whose rounding gives the
    tile the least squared error, the first on a tie; values beyond +-448 clip. The default (1.0,)
    maps each tile's largest magnitude to e4m3's largest; model weights quantized at load pass
    SEARCHED_SCALE_FACTORS. Worked through about `chunk_elements` float32 values at a time (whole
    tile rows of one or more matrices; None: CHUNK_ELEMENTS for the weight's device), so a large
    expert stack never has a float32 copy."""
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS["cuda" if weight.is_cuda else "cpu"]
    *lead, n, k = weight.shape
    rows, cols = block_grid((n, k), block)
    stacked = weight.reshape(-1, n, k)
    values = torch.empty(stacked.shape, dtype=FP8, device=weight.device)
    scale_inv = torch.empty(stacked.shape[0], rows, cols, dtype=torch.float32, device=weight.device)
    row_elements = block[0] * cols * block[1]
    tile_rows = max(1, min(rows, chunk_elements // row_elements))
    matrices = max(1, chunk_elements // (rows * row_elements)) if tile_rows == rows else 1
    for first in range(0, stacked.shape[0], matrices):
        for row in range(0, rows, tile_rows):
            top, bottom = row * block[0], min(n, (row + tile_rows) * block[0])
            part = stacked[first : first + matrices, top:bottom]
            part_values, part_scale_inv = _quantize_tile_rows(part, block, scale_factors)
            values[first : first + matrices, top:bottom] = part_values
            scale_inv[first : first + matrices, row : row + tile_rows] = part_scale_inv
    return values.reshape(weight.shape), scale_inv.reshape(*lead, rows, cols)


def _quantize_tile_rows(
    weight: torch.Tensor, block: tuple[int, int], scale_factors: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight_blocks of [M, n, K] whose rows start on a tile boundary."""
    m, n, k = weight.shape
    rows, cols = block_grid((n, k), block)
    padded = torch.zeros(m, rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:, :n, :k] = weight
    tiles = padded.unflatten(-1, (cols, block[1])).unflatten(-3, (rows, block[0]))  # [M, rows, bn, cols, bk]
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=MIN_AMAX)
    scale_inv = amax / FP8_MAX
    if len(scale_factors) > 1:
        scale_inv = _least_error_scale(tiles, amax, scale_factors)
    values = (tiles / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.flatten(-2).flatten(-3, -2)[:, :n, :k], scale_inv.squeeze(-1).squeeze(-2)


def _least_error_scale(tiles: torch.Tensor, amax: torch.Tensor, scale_factors: tuple[float, ...]) -> torch.Tensor:
    """Per tile, the scale_inv among amax * factor / 448 whose rounding has the least squared error
    (each 1 x block_k row's sum in float32, the tile's in float64: a chunk's tiles compare as the
    whole matrix's would)."""
    best_scale = best_error = None
    for factor in scale_factors:
        scale_inv = amax * factor / FP8_MAX
        real = (tiles / scale_inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8).float().mul_(scale_inv)
        row_error = real.sub_(tiles).square_().sum(dim=-1, keepdim=True)
        error = row_error.sum(dim=-3, keepdim=True, dtype=torch.float64)
        if best_error is None:
            best_scale, best_error = scale_inv, error
            continue
        better = error < best_error
        best_scale = torch.where(better, scale_inv, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_scale


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
