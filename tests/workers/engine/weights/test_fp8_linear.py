"""Fp8Linear and fp8 routed experts: off CUDA they compute exactly what the W8A8 reference computes
from the same e4m3 tiles; fused projections load part by part, exactly where the parts end on tile
boundaries and as one requantized matrix where they do not. On CUDA (gpu mark) the kernels agree
with the reference."""

import pytest
import torch

from kernels.moe import experts_reference
from kernels.quant.fp8_blocks import (
    FP8,
    SEARCHED_SCALE_FACTORS,
    dequantize_weight_blocks,
    quantize_weight_blocks,
    w8a8_block_matmul_reference,
)
from workers.engine.layers.fp8_linear import Fp8Linear
from workers.engine.layers.moe import RoutedExperts
from workers.engine.weights.quantization import BlockQuantized

BLOCK = (128, 128)


def random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def searched(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 tiles a float weight is quantized to at load."""
    return quantize_weight_blocks(weight, BLOCK, scale_factors=SEARCHED_SCALE_FACTORS)


def saved(weight: torch.Tensor) -> BlockQuantized:
    return BlockQuantized(*quantize_weight_blocks(weight, BLOCK), block=BLOCK)


def loaded_linear(parts: list[torch.Tensor | BlockQuantized], in_features: int, *, bias: torch.Tensor | None = None):
    out_features = sum(part.shape[0] for part in parts)
    layer = Fp8Linear(in_features, out_features, bias=bias is not None, block=BLOCK)
    offset = 0
    for index, part in enumerate(parts):
        layer.load_rows(offset, part, f"part {index}")
        offset += part.shape[0]
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def test_fp8_linear_off_cuda_equals_the_w8a8_reference_exactly():
    # K and N not multiples of the block: partial tiles at both edges.
    weight, bias, x = random(300, 200, seed=1), random(300, seed=2), random(2, 5, 200, seed=3) * 4
    part = saved(weight)
    layer = loaded_linear([part], 200, bias=bias)
    layer.finish_loading(torch.float32)

    assert not layer.quantized and layer.weight.dtype == torch.float32
    assert torch.equal(layer(x), w8a8_block_matmul_reference(x, part.values, part.scale_inv, BLOCK, bias))


def test_tile_aligned_parts_load_their_own_tiles_exactly():
    gate, up = saved(random(128, 96, seed=1)), saved(random(40, 96, seed=2))  # up ends at N: aligned too
    layer = loaded_linear([gate, up], 96)

    assert torch.equal(layer.weight[:128].view(torch.uint8), gate.values.view(torch.uint8))
    assert torch.equal(layer.weight[128:].view(torch.uint8), up.values.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, torch.cat([gate.scale_inv, up.scale_inv]))


@pytest.mark.parametrize("as_saved", [False, True], ids=["float parts", "e4m3 parts"])
def test_parts_off_tile_boundaries_are_quantized_as_one_matrix(as_saved):
    q, k, v = random(64, 96, seed=1), random(32, 96, seed=2) * 10, random(32, 96, seed=3)
    parts = [q, k, v]
    if as_saved:
        parts = [saved(part) for part in parts]
    layer = loaded_linear(parts, 96)
    layer.finish_loading(torch.float32)
    whole = torch.cat([part.dequantize(torch.float32) if as_saved else part for part in parts])

    assert torch.equal(layer.weight, dequantize_weight_blocks(*searched(whole), BLOCK))


def test_float_parts_get_searched_scales_and_aligned_ones_keep_their_own_tiles():
    # q fills tile rows 0-1 on its own; k and v share tile row 2, assembled and quantized at the end.
    q, k, v = random(256, 256, seed=1) * 0.02, random(32, 256, seed=2) * 0.02, random(32, 256, seed=3) * 0.02
    layer = loaded_linear([q, k, v], 256)
    layer.finish_loading(torch.float32)
    q_values, q_scale = searched(q)
    kv_values, kv_scale = searched(torch.cat([k, v]))

    assert torch.equal(layer.weight[:256], dequantize_weight_blocks(q_values, q_scale, BLOCK))
    assert torch.equal(layer.weight[256:], dequantize_weight_blocks(kv_values, kv_scale, BLOCK))
    # Searched, not amax's: some tiles' scales differ.
    assert not torch.equal(q_scale, quantize_weight_blocks(q, BLOCK)[1])


def test_fp8_experts_off_cuda_are_the_saved_tiles_dequantized_and_quantize_their_activations():
    num_experts, hidden, intermediate = 4, 64, 128
    experts = RoutedExperts(num_experts, hidden, intermediate)
    experts.use_fp8(BLOCK)
    saved_parts = {}
    for expert in range(num_experts):
        for index, (projection, shape) in enumerate(
            [("gate", (intermediate, hidden)), ("up", (intermediate, hidden)), ("down", (hidden, intermediate))]
        ):
            saved_parts[expert, projection] = saved(random(*shape, seed=10 * expert + index))
            experts.load_expert_weight(expert, projection, saved_parts[expert, projection])
    experts.finish_loading(torch.float32)
    hidden_states = random(6, hidden, seed=99)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(5))
    real = {key: part.dequantize(torch.float32) for key, part in saved_parts.items()}
    w13 = torch.stack([torch.cat([real[e, "gate"], real[e, "up"]]) for e in range(num_experts)])
    w2 = torch.stack([real[e, "down"] for e in range(num_experts)])

    assert not experts.quantized and experts.w13_scale_inv is None
    assert torch.equal(experts.w13, w13) and torch.equal(experts.w2, w2)
    out = experts(hidden_states, ids, weights)

    # what the FP8 kernels compute from the saved e4m3 tiles: activations quantized per 1 x 128 group
    def stacked(name: str, projections: tuple[str, ...]) -> torch.Tensor:
        return torch.stack([torch.cat([getattr(saved_parts[e, p], name) for p in projections]) for e in range(4)])

    tiles = {name: stacked(name, ("gate", "up")) for name in ("values", "scale_inv")}
    down = {name: stacked(name, ("down",)) for name in tiles}
    kernel = experts_reference(
        hidden_states,
        tiles["values"],
        down["values"],
        ids,
        weights,
        w13_scale_inv=tiles["scale_inv"],
        w2_scale_inv=down["scale_inv"],
        block=BLOCK,
    )
    torch.testing.assert_close(out, kernel, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out, experts_reference(hidden_states, w13, w2, ids, weights), rtol=1e-4, atol=1e-4)


def test_random_fp8_experts_hold_their_float_weights_quantized_with_searched_scales():
    experts = RoutedExperts(3, 256, 192)
    w13, w2 = random(3, 384, 256, seed=1) * 0.02, random(3, 256, 192, seed=2) * 0.02
    experts.use_fp8(BLOCK)
    experts.load_experts("w13", 0, w13)
    experts.load_experts("w2", 0, w2)
    experts.finish_loading(torch.float32)

    assert torch.equal(experts.w13, dequantize_weight_blocks(*searched(w13), BLOCK))
    assert torch.equal(experts.w2, dequantize_weight_blocks(*searched(w2), BLOCK))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_linear_on_cuda_keeps_e4m3_and_matches_the_reference():
    weight, x = random(384, 256, seed=1), random(7, 256, seed=2).cuda().bfloat16()
    part = saved(weight)
    layer = loaded_linear([part], 256).cuda()
    layer.finish_loading(torch.bfloat16)
    expected = w8a8_block_matmul_reference(x, part.values.cuda(), part.scale_inv.cuda(), BLOCK)

    assert layer.quantized and layer.weight.dtype == FP8
    torch.testing.assert_close(layer(x), expected, atol=2e-2, rtol=2e-2)
