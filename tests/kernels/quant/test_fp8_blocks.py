"""Block quantization of weights (kernels.quant.fp8_blocks.quantize_weight_blocks): each tile's scale
is amax / 448 by default, or searched over SEARCHED_SCALE_FACTORS for the least squared rounding
error, which is never more than amax's; either way DeepSeek-V3's format, the same whichever chunks it
is worked through in.

Tile errors are compared in float64 from the dequantized float32 weights. The search sums them in
float64 too, but from float32 differences, so a tile where two scales' errors are equal to float32
rounding may compare either way: the bound allows 1e-6 of the tile's error."""

import pytest
import torch

from kernels.quant.fp8_blocks import (
    FP8,
    FP8_MAX,
    SEARCHED_SCALE_FACTORS,
    block_grid,
    dequantize_weight_blocks,
    quantize_weight_blocks,
)

BLOCK = (128, 128)
SEARCHED = dict(scale_factors=SEARCHED_SCALE_FACTORS)
# [..., N, K]: whole tiles; partial tiles at both edges; an expert stack; two leading dims.
SHAPES = [(256, 384), (300, 200), (3, 257, 130), (2, 2, 129, 64)]


def normal(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def heavy_tailed(*shape: int, seed: int = 0) -> torch.Tensor:
    """Normal values with log-normal magnitudes: a few values per tile far beyond the rest."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * torch.randn(*shape, generator=generator).mul(1.5).exp() * 0.02


def tile_errors(weight: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The squared error of each tile of `weight` [..., N, K] quantized, [..., rows, cols]."""
    *lead, n, k = weight.shape
    rows, cols = block_grid((n, k), BLOCK)
    error = (dequantize_weight_blocks(values, scale_inv, BLOCK).double() - weight.double()).square()
    padded = torch.zeros(*lead, rows * BLOCK[0], cols * BLOCK[1], dtype=torch.float64)
    padded[..., :n, :k] = error
    return padded.unflatten(-1, (cols, BLOCK[1])).unflatten(-3, (rows, BLOCK[0])).sum(dim=(-3, -1))


def test_the_searched_factors_start_with_amax():
    # The first factor wins ties, as for a tile of zeros: amax's scale unless another is better.
    assert SEARCHED_SCALE_FACTORS[0] == 1.0 and len(set(SEARCHED_SCALE_FACTORS)) == len(SEARCHED_SCALE_FACTORS)


@pytest.mark.parametrize("make", [normal, heavy_tailed])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_searched_tile_errs_no_more_than_its_amax_scale(shape, make):
    weight = make(*shape)
    amax_error = tile_errors(weight, *quantize_weight_blocks(weight, BLOCK))
    searched_error = tile_errors(weight, *quantize_weight_blocks(weight, BLOCK, **SEARCHED))

    assert (searched_error <= amax_error * (1 + 1e-6)).all()
    assert searched_error.sum() < amax_error.sum()  # and the search finds better scales for some tiles


@pytest.mark.parametrize("make", [normal, heavy_tailed])
def test_each_searched_scale_is_one_of_the_factors_times_the_amax_scale(make):
    weight = make(300, 200)
    _, amax_scale = quantize_weight_blocks(weight, BLOCK)
    _, searched_scale = quantize_weight_blocks(weight, BLOCK, **SEARCHED)
    factors = torch.tensor(SEARCHED_SCALE_FACTORS)

    nearest = (searched_scale / amax_scale).unsqueeze(-1).sub(factors).abs().min(dim=-1).values
    assert (nearest < 1e-6).all()


@pytest.mark.parametrize("search", [False, True], ids=["amax", "searched"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_format_is_e4m3_and_a_positive_scale_per_tile(shape, search):
    weight = heavy_tailed(*shape).to(torch.bfloat16)
    values, scale_inv = quantize_weight_blocks(weight, BLOCK, **(SEARCHED if search else {}))

    assert values.dtype == FP8 and values.shape == weight.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (*shape[:-2], *block_grid(shape[-2:], BLOCK))
    assert values.float().isfinite().all() and (values.float().abs() <= FP8_MAX).all()
    assert scale_inv.isfinite().all() and (scale_inv > 0).all()


def test_amax_maps_each_tiles_largest_magnitude_to_448():
    weight = heavy_tailed(300, 200)
    values, _ = quantize_weight_blocks(weight, BLOCK)
    largest = torch.zeros(3, 2)
    for row in range(3):
        for col in range(2):
            largest[row, col] = values[row * 128 : (row + 1) * 128, col * 128 : (col + 1) * 128].float().abs().max()

    assert (largest == FP8_MAX).all()


@pytest.mark.parametrize("search", [False, True], ids=["amax", "searched"])
@pytest.mark.parametrize(
    "chunk_elements",
    [1, 128 * 256, 3 * 128 * 256, 5 * 256 * 256],  # a tile row; three; a few whole matrices
)
def test_chunks_give_exactly_what_the_whole_gives(chunk_elements, search):
    weight = heavy_tailed(7, 300, 200)  # each matrix 3 tile rows of 2 tiles
    options = SEARCHED if search else {}
    whole_values, whole_scale = quantize_weight_blocks(weight, BLOCK, chunk_elements=1 << 30, **options)
    values, scale_inv = quantize_weight_blocks(weight, BLOCK, chunk_elements=chunk_elements, **options)

    assert torch.equal(values.view(torch.uint8), whole_values.view(torch.uint8))
    assert torch.equal(scale_inv, whole_scale)


def test_an_expert_quantizes_as_it_does_alone_in_its_stack():
    stack = normal(4, 300, 200)
    values, scale_inv = quantize_weight_blocks(stack, BLOCK, **SEARCHED)
    alone_values, alone_scale = quantize_weight_blocks(stack[2], BLOCK, **SEARCHED)

    assert torch.equal(values[2].view(torch.uint8), alone_values.view(torch.uint8))
    assert torch.equal(scale_inv[2], alone_scale)


@pytest.mark.parametrize("search", [False, True], ids=["amax", "searched"])
def test_tiles_of_zeros_stay_zeros_with_a_finite_scale(search):
    weight = normal(300, 200)
    weight[:128, :128] = 0  # a whole tile
    weight[256:, 128:] = 0  # the partial corner tile
    values, scale_inv = quantize_weight_blocks(weight, BLOCK, **(SEARCHED if search else {}))
    real = dequantize_weight_blocks(values, scale_inv, BLOCK)

    assert (real[:128, :128] == 0).all() and (real[256:, 128:] == 0).all()
    assert scale_inv.isfinite().all() and (scale_inv > 0).all()
    assert torch.equal(quantize_weight_blocks(torch.zeros(130, 5), BLOCK, **SEARCHED)[0].float(), torch.zeros(130, 5))


def test_the_search_is_deterministic():
    weight = heavy_tailed(3, 257, 130)
    first = quantize_weight_blocks(weight, BLOCK, **SEARCHED)
    second = quantize_weight_blocks(weight.clone(), BLOCK, **SEARCHED)

    assert torch.equal(first[0].view(torch.uint8), second[0].view(torch.uint8)) and torch.equal(first[1], second[1])
