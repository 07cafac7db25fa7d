"""The W8A8 block-scaled FP8 GEMM (kernels.quant.fp8_gemm) against its torch reference
(kernels.quant.fp8_blocks.w8a8_block_matmul_reference), on CUDA when there is one, else on the CPU
under Triton's interpreter at small sizes; the gpu-marked tests at Llama-3.1-8B's projection sizes and
in a CUDA graph.

Tolerances. Kernel against reference: both quantize every activation to the same e4m3 value (the
same float32 arithmetic; test_prologue_rounds_as_the_reference checks it value by value) and the
weights are the same e4m3 tiles, so what is left is float32 summation order and where the scales
multiply in (per 128-deep product in the kernel, per element in the reference): a few float32 ulps of
each 128-term sum, under 1e-5 relative here. In float32 that is TIGHT; in bfloat16 and float16
both sides round that float32 to the output dtype, where a few ulps of float32 can flip a rounding
(and the interpreter truncates float32 -> bfloat16 where CUDA rounds to nearest even): one unit in
the last place, 2^-7 relative for bfloat16, 2^-10 for float16. On the GPU the tensor cores sum
each 128-deep e4m3 product with fewer than float32's bits (~2^-13 relative of that partial sum,
~1e-4 of these outputs): still inside a bfloat16 unit, but TIGHT there is 1e-3, not 1e-5.

Reference against the unquantized x @ W.T: e4m3 keeps 3 mantissa bits, so rounding to it moves a
value by up to 2^-4 of itself, ~2.5% RMS for these Gaussian operands; with both operands rounded
the product's relative error (Frobenius) measures 2.4-2.8% at these sizes, bounded here by 5%.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.quant.fp8_blocks import (  # noqa: E402
    FP8_MAX,
    quantize_activation_groups,
    quantize_weight_blocks,
    w8a8_block_matmul_reference,
)
from kernels.quant.fp8_gemm import (  # noqa: E402
    CUBLAS_AGREEMENT,
    CUBLAS_MIN_M,
    GemmConfig,
    block_fp8_matmul_with,
    gemm_config,
    w8a8_block_fp8_matmul,
)
from kernels.quant.fp8_gemv import GemvConfig, block_fp8_gemv_with, gemv_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# On the GPU the tensor cores' shorter FP8 sums (~2^-13 of a 128-deep partial sum, ~1e-4 here) set
# the absolute floor instead of float32's.
SUMS_ATOL = 1e-5 if DEVICE.type == "cpu" else 1e-3
TIGHT = dict(atol=SUMS_ATOL, rtol=1e-5 if DEVICE.type == "cpu" else 1e-3)
ONE_ULP = {
    torch.float32: TIGHT,
    torch.bfloat16: dict(atol=SUMS_ATOL, rtol=2**-7),
    torch.float16: dict(atol=SUMS_ATOL, rtol=2**-10),
}
QUANTIZATION_ERROR_BOUND = 0.05
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_inputs(lead, n, k, dtype=torch.bfloat16, block=(128, 128), bias=False, seed=0, device=DEVICE):
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(*lead, k, device=device, generator=generator).to(dtype)
    weight = torch.randn(n, k, device=device, generator=generator) * k**-0.5
    values, scale_inv = quantize_weight_blocks(weight, block)
    b = torch.randn(n, device=device, generator=generator).to(dtype) if bias else None
    return x, weight, values, scale_inv, b


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


@pytest.mark.parametrize(
    "lead, n, k, dtype, bias",
    [
        ((1,), 200, 300, torch.bfloat16, True),  # one token; N and K not multiples of 128
        ((5,), 130, 256, torch.float16, False),
        ((3, 11), 96, 200, torch.float32, True),  # leading dims: 33 rows
        ((33,), 256, 384, torch.bfloat16, False),
    ],
)
def test_kernel_equals_the_reference(lead, n, k, dtype, bias):
    x, _, values, scale_inv, b = make_inputs(lead, n, k, dtype, bias=bias)
    out = w8a8_block_fp8_matmul(x, values, scale_inv, (128, 128), b)
    assert out.dtype == dtype and out.shape == (*lead, n)
    torch.testing.assert_close(out, w8a8_block_matmul_reference(x, values, scale_inv, (128, 128), b), **ONE_ULP[dtype])


@pytest.mark.parametrize(
    "block, config",
    [
        ((128, 128), GemmConfig(block_m=16, block_n=256, num_warps=4, num_stages=2)),  # columns straddle tiles
        ((128, 128), GemmConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, group_m=2)),
        ((64, 32), GemmConfig(block_m=16, block_n=128, num_warps=4, num_stages=2)),  # another block shape
        # K groups split over programs, partials summed (160 channels: 2 groups of 128, 5 of 32).
        ((128, 128), GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, split_k=2)),
        ((64, 32), GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, split_k=3)),
        # The activation quantized in a pass of its own, as prefill does.
        ((128, 128), GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=2, prequantize=True)),
        ((64, 32), GemmConfig(block_m=16, block_n=128, num_warps=4, num_stages=2, prequantize=True, split_k=2)),
    ],
)
def test_tile_configs_and_block_shapes_agree_with_the_reference(block, config):
    x, _, values, scale_inv, b = make_inputs((40,), 300, 160, torch.float32, block=block, bias=True)
    out = block_fp8_matmul_with(x, values, scale_inv, block, b, config)
    torch.testing.assert_close(out, w8a8_block_matmul_reference(x, values, scale_inv, block, b), **TIGHT)


@pytest.mark.parametrize(
    "rows, block, config",
    [
        (1, (128, 128), GemvConfig(block_n=32, groups_per_step=2, num_warps=4)),  # 3 groups: a partial step
        (3, (128, 128), GemvConfig(block_n=256, groups_per_step=1, num_warps=4)),  # columns straddle tiles
        (2, (64, 32), GemvConfig(block_n=16, groups_per_step=4, num_warps=2)),  # another block shape
        (4, (64, 32), GemvConfig(block_n=8, groups_per_step=8, num_warps=4)),  # more groups a step than K has
    ],
)
def test_gemv_configs_and_block_shapes_agree_with_the_reference(rows, block, config):
    x, _, values, scale_inv, b = make_inputs((rows,), 300, 160 if block[1] == 32 else 300, torch.float32, block, True)
    out = block_fp8_gemv_with(x, values, scale_inv, block, b, config)
    torch.testing.assert_close(out, w8a8_block_matmul_reference(x, values, scale_inv, block, b), **TIGHT)


def test_gemv_column_blocks_narrow_until_the_programs_fill_the_device():
    from kernels.quant.fp8_gemv import MIN_PROGRAMS, SLAB_BYTES

    narrow, wide = gemv_config(1, 4096, 4096), gemv_config(1, 28672, 4096)
    assert narrow.block_n < wide.block_n and 4096 // narrow.block_n >= MIN_PROGRAMS
    for config in (narrow, wide):
        assert config.block_n * config.groups_per_step * 128 <= SLAB_BYTES
    assert gemv_config(1, 64, 256).groups_per_step == 2  # no more groups a step than K holds


def test_prologue_rounds_as_the_reference():
    # An identity weight (each diagonal e4m3 value 448, scale_inv 1 / 448) passes the kernel's
    # quantized activations through: a value rounded to another e4m3 would be off by >= 1/16 of
    # itself. Group 0's amax is 448 (its scale is 1), so its values are rounded as written: ties go
    # to even (2.625 -> 2.5, 3.125 -> 3.0, 17 -> 16), and 1.98 carries into the exponent (-> 2.0).
    k = 160
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    x[0, :6] = torch.tensor([FP8_MAX, 2.625, -3.125, 1.984375, 0.4961, 17.0])
    x[2] = 0.0  # a zero row: its groups still get a finite scale
    values, scale_inv = quantize_weight_blocks(torch.eye(k), (128, 128))
    out = w8a8_block_fp8_matmul(x.to(DEVICE), values.to(DEVICE), scale_inv.to(DEVICE)).cpu()
    x_values, x_scales = quantize_activation_groups(x, 128)
    dequantized = x_values.float() * x_scales.repeat_interleave(128, dim=-1)[:, :k]
    torch.testing.assert_close(out, dequantized, atol=0, rtol=1e-6)
    torch.testing.assert_close(out[0, :6], torch.tensor([FP8_MAX, 2.5, -3.0, 2.0, 0.5, 16.0]), atol=0, rtol=1e-6)
    assert torch.equal(out[2], torch.zeros(k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_close_to_the_unquantized_product(dtype):
    x, weight, values, scale_inv, _ = make_inputs((33,), 200, 300, dtype)
    reference = w8a8_block_matmul_reference(x, values, scale_inv, (128, 128))
    exact = x.float() @ weight.T
    assert relative_error(reference, exact) < QUANTIZATION_ERROR_BOUND


def test_no_rows_gives_an_empty_result():
    x, _, values, scale_inv, _ = make_inputs((0,), 64, 128)
    assert w8a8_block_fp8_matmul(x, values, scale_inv).shape == (0, 64)


def test_configs_split_k_for_a_few_rows_and_prequantize_for_many():
    from kernels.quant.fp8_gemm import MIN_PROGRAMS

    # Decode: few column blocks of a narrow weight split their K loop until MIN_PROGRAMS are in
    # flight; a wide weight has the programs already; no split exceeds the K groups.
    narrow, wide = gemm_config(1, 4096, 4096), gemm_config(1, 28672, 4096)
    assert narrow.block_m == 16 and narrow.split_k > wide.split_k >= 1
    assert (4096 // narrow.block_n) * narrow.split_k >= MIN_PROGRAMS
    assert gemm_config(1, 64, 256).split_k == 2
    assert not narrow.prequantize and gemm_config(64, 4096, 4096).split_k == 1
    prefill = gemm_config(8192, 4096, 4096)
    assert prefill.block_m == prefill.block_n == 128 and prefill.prequantize and prefill.split_k == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda i: {**i, "weight": i["weight"].bfloat16()}, "weight must be a 2-D torch.float8_e4m3fn"),
        (lambda i: {**i, "x": i["x"][:, :-1]}, r"x must be \[\.\.\., 300\]"),
        (lambda i: {**i, "x": i["x"].double()}, "x must be bfloat16, float16 or float32"),
        (lambda i: {**i, "scale": i["scale"][:, :-1]}, r"weight_scale_inv must be float32 \(2, 3\)"),
        (lambda i: {**i, "scale": i["scale"].bfloat16()}, "weight_scale_inv must be float32"),
        (lambda i: {**i, "block": (128, 96)}, "block_k must be a power of two"),
        (lambda i: {**i, "bias": i["weight"][0].float()}, r"bias must be a floating \[200\]"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    x, _, values, scale_inv, _ = make_inputs((4,), 200, 300, device=torch.device("cpu"))
    bad = change({"x": x, "weight": values, "scale": scale_inv, "block": (128, 128), "bias": None})
    with pytest.raises(ValueError, match=message):
        w8a8_block_fp8_matmul(bad["x"], bad["weight"], bad["scale"], bad["block"], bad["bias"])


# On the accelerator machine: Llama-3.1-8B's projections (qkv, o, gate-up, down) as [N, K].
LLAMA_8B_PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n, k", LLAMA_8B_PROJECTIONS)
@pytest.mark.parametrize("m", [1, 16, 200, 4096])
def test_gpu_kernel_equals_the_reference_at_llama_8b_sizes(m, n, k):
    x, weight, values, scale_inv, b = make_inputs((m,), n, k, torch.bfloat16, bias=True, seed=m)
    out = w8a8_block_fp8_matmul(x, values, scale_inv, (128, 128), b)
    reference = w8a8_block_matmul_reference(x, values, scale_inv, (128, 128), b)
    if m > CUBLAS_MIN_M:
        # Prefill sizes run on torch's blockwise FP8 GEMM where it is offered: it sums in its own
        # order, so it agrees with the reference as a whole (the bound its start-up probe holds it
        # to), not to one ulp per element (an H100 left 2% of outputs near zero a few ulps apart).
        assert relative_error(out, reference) < CUBLAS_AGREEMENT
    else:
        torch.testing.assert_close(out, reference, **ONE_ULP[torch.bfloat16])
    assert relative_error(reference, x.float() @ weight.T + b.float()) < QUANTIZATION_ERROR_BOUND


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n, k", LLAMA_8B_PROJECTIONS)
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_gemv_equals_the_reference_at_llama_8b_sizes_and_replays_in_a_cuda_graph(m, n, k):
    x, _, values, scale_inv, b = make_inputs((m,), n, k, torch.bfloat16, bias=True, seed=m)
    config = gemv_config(m, n, k)
    block_fp8_gemv_with(x, values, scale_inv, (128, 128), b, config)  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_fp8_gemv_with(x, values, scale_inv, (128, 128), b, config)
    graph.replay()
    reference = w8a8_block_matmul_reference(x, values, scale_inv, (128, 128), b)
    torch.testing.assert_close(out, reference, **ONE_ULP[torch.bfloat16])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 64, 1024])
def test_gpu_kernel_replays_in_a_cuda_graph(m):
    x, _, values, scale_inv, _ = make_inputs((m,), 4096, 4096)
    w8a8_block_fp8_matmul(x, values, scale_inv)  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a8_block_fp8_matmul(x, values, scale_inv)
    for seed in (1, 2):
        x.copy_(make_inputs((m,), 4096, 4096, seed=seed)[0])
        graph.replay()
        reference = w8a8_block_matmul_reference(x, values, scale_inv, (128, 128))
        if m > CUBLAS_MIN_M:  # torch's blockwise GEMM, held to its probe's whole-output agreement
            assert relative_error(out, reference) < CUBLAS_AGREEMENT
        else:
            torch.testing.assert_close(out, reference, **ONE_ULP[torch.bfloat16])
