"""The norm-prologue skinny GEMMs (kernels.fused.linear, kernels.fused.qkv_rotary) against their torch
references.

Small cases run on CUDA when there is one, otherwise on the CPU through Triton's interpreter; the
gpu-marked tests repeat them at SmolLM2's sizes and replay every op in a CUDA graph.

Tolerances are test_fused_ops.py's (two units in the last place of the output dtype) with one
exception: Triton 3.6's interpreter truncates float32 -> bfloat16 where CUDA rounds to nearest even,
and a GEMM sums K products of truncated operands (h, the normed row, and the rounded projection
before an epilogue), so there a bfloat16 output's error follows the size of the output's terms,
not of each output: it is held to 4% of the largest output instead.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.fused import (  # noqa: E402
    add_rms_norm_gate_up_silu,
    add_rms_norm_gate_up_silu_reference,
    add_rms_norm_linear,
    add_rms_norm_linear_reference,
    add_rms_norm_qkv_rotary,
    add_rms_norm_qkv_rotary_reference,
    linear,
)
from kernels.fused.linear import BLOCKS, INTERPRETER_BLOCKS, Blocks, blocks_for  # noqa: E402
from workers.engine.config import RopeConfig  # noqa: E402
from workers.engine.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (2e-2, 1e-2)}
EPS = 1e-5
SENTINEL = -7.0  # what the caches hold before a write; exact in every dtype
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def cuda_block_shapes(monkeypatch):
    """The CUDA table's block shapes on the CPU too, so the interpreter runs the GPU's tiles."""
    monkeypatch.setattr(linear, "INTERPRETER_BLOCKS", BLOCKS)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def assert_gemm_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    if INTERPRETED and expected.dtype == torch.bfloat16:
        atol = 0.04 * expected.float().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, device: torch.device = DEVICE) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def rows_of_wider(tokens: int, hidden: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """[tokens, hidden] whose rows are strided, as a view into a wider buffer."""
    return randn(tokens, hidden + 16, dtype=dtype, device=device)[:, :hidden]


def prologue_inputs(tokens, hidden, dtype, *, residual=True, device=DEVICE):
    x = rows_of_wider(tokens, hidden, dtype, device)
    res = randn(tokens, hidden, dtype=dtype, device=device) if residual else None
    norm_weight = (1.0 + randn(hidden, dtype=torch.float32, scale=0.1, device=device)).to(dtype)
    return x, res, norm_weight


def linear_weight(out_features, hidden, dtype, device=DEVICE):
    """Unit-variance outputs: weights of std 1/sqrt(hidden), rows strided (a slice of a wider matrix)."""
    return randn(out_features, hidden + 8, dtype=dtype, scale=hidden**-0.5, device=device)[:, :hidden]


def check_unchanged(tensors: dict[str, torch.Tensor | None], copies: dict[str, torch.Tensor | None]) -> None:
    for name, tensor in tensors.items():
        if tensor is not None:
            assert torch.equal(tensor, copies[name]), f"{name} was modified"


# add_rms_norm_linear


def check_linear(tokens, hidden, out_features, dtype, *, residual, bias, out_dtype=None, device=DEVICE):
    x, res, norm_weight = prologue_inputs(tokens, hidden, dtype, residual=residual, device=device)
    weight = linear_weight(out_features, hidden, dtype, device)
    b = randn(out_features, dtype=dtype, device=device) if bias else None
    inputs = {"x": x, "residual": res}
    copies = {name: t.clone() if t is not None else None for name, t in inputs.items()}
    expected, expected_residual = add_rms_norm_linear_reference(
        x, res, norm_weight, EPS, weight, b, out_dtype=out_dtype
    )

    out, new_residual = add_rms_norm_linear(x, res, norm_weight, EPS, weight, b, out_dtype=out_dtype)

    assert out.shape == (tokens, out_features) and out.dtype == (out_dtype or dtype) and out.is_contiguous()
    assert_gemm_close(out.to(dtype), expected.to(dtype))  # a float32 out holds x-dtype values
    assert_close(new_residual, expected_residual)
    check_unchanged(inputs, copies)
    if res is None:
        assert new_residual is x
    else:
        assert new_residual.data_ptr() not in (x.data_ptr(), res.data_ptr())


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("residual", "bias"), [(True, False), (False, True), (True, True)])
def test_linear_matches_reference(tokens, dtype, residual, bias):
    # hidden 96 and 80 outputs: neither a multiple of the 64-wide blocks.
    check_linear(tokens, 96, 80, dtype, residual=residual, bias=bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_writes_float32_logits_of_the_rounded_values(dtype):
    """out_dtype float32 holds exactly the x-dtype output widened, as compute_logits' .float() does."""
    x, res, norm_weight = prologue_inputs(3, 96, dtype)
    weight = linear_weight(80, 96, dtype)

    logits, _ = add_rms_norm_linear(x, res, norm_weight, EPS, weight, out_dtype=torch.float32)
    rounded, _ = add_rms_norm_linear(x, res, norm_weight, EPS, weight)

    assert logits.dtype == torch.float32
    assert torch.equal(logits, rounded.float())


def test_float32_norm_weight_with_half_inputs():
    x, res, _ = prologue_inputs(3, 96, torch.bfloat16)
    norm_weight = 1.0 + randn(96, dtype=torch.float32, scale=0.1)
    weight = linear_weight(80, 96, torch.bfloat16)
    expected, _ = add_rms_norm_linear_reference(x, res, norm_weight, EPS, weight)

    out, _ = add_rms_norm_linear(x, res, norm_weight, EPS, weight)

    assert out.dtype == torch.bfloat16
    assert_gemm_close(out, expected)


def test_many_row_and_column_blocks(monkeypatch):
    """16-row blocks over 17 rows: two row blocks, five column blocks, one writer per residual row;
    16-column halves hold whole heads of 32."""
    small = ((256, Blocks(16, 16, 64, 4, 2)),)
    for kernel in BLOCKS:
        monkeypatch.setitem(BLOCKS, kernel, small)
    check_linear(17, 96, 80, torch.float32, residual=True, bias=True)
    check_gate_up(17, 96, 40, torch.float32, residual=True)
    check_qkv(17, 96, 3, 1, 32, torch.float32, residual=True, bias=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_tiles_of_several_heads(monkeypatch, dtype):
    """64-column halves over heads of 32: a tile holds two heads (q beside k, k beside v) and the last
    one is a quarter full."""
    monkeypatch.setitem(BLOCKS, "qkv", ((256, Blocks(16, 64, 64, 4, 2)),))
    check_qkv(3, 96, 3, 1, 32, dtype, residual=True, bias=True)


# add_rms_norm_gate_up_silu


def check_gate_up(tokens, hidden, intermediate, dtype, *, residual, device=DEVICE):
    x, res, norm_weight = prologue_inputs(tokens, hidden, dtype, residual=residual, device=device)
    weight = linear_weight(2 * intermediate, hidden, dtype, device)
    copies = {"x": x.clone(), "residual": res.clone() if res is not None else None}
    expected, expected_residual = add_rms_norm_gate_up_silu_reference(x, res, norm_weight, EPS, weight)

    out, new_residual = add_rms_norm_gate_up_silu(x, res, norm_weight, EPS, weight)

    assert out.shape == (tokens, intermediate) and out.dtype == dtype
    assert_gemm_close(out, expected)
    assert_close(new_residual, expected_residual)
    check_unchanged({"x": x, "residual": res}, copies)


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [True, False])
def test_gate_up_silu_matches_reference(tokens, dtype, residual):
    check_gate_up(tokens, 96, 40, dtype, residual=residual)  # 40 columns: 2.5 blocks of 16


# add_rms_norm_qkv_rotary


def qkv_inputs(tokens, hidden, num_heads, kv_heads, head_dim, dtype, *, residual, bias, pages, page_size, device):
    x, res, norm_weight = prologue_inputs(tokens, hidden, dtype, residual=residual, device=device)
    rows = (num_heads + 2 * kv_heads) * head_dim
    weight = linear_weight(rows, hidden, dtype, device)
    b = randn(rows, dtype=dtype, device=device) if bias else None
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, max_positions=4096).to(device)
    k_cache = torch.full((kv_heads, pages, page_size, head_dim), SENTINEL, dtype=dtype, device=device)
    return x, res, norm_weight, weight, b, rotary.cos, rotary.sin, k_cache, k_cache.clone()


def check_qkv(tokens, hidden, num_heads, kv_heads, head_dim, dtype, *, residual, bias, device=DEVICE, pages=6):
    page_size = 4
    x, res, norm_weight, weight, b, cos, sin, k_cache, v_cache = qkv_inputs(
        tokens, hidden, num_heads, kv_heads, head_dim, dtype,
        residual=residual, bias=bias, pages=pages, page_size=page_size, device=device,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 4096, (tokens,), generator=generator).to(device)
    slots = torch.randperm(pages * page_size, generator=generator)[:tokens].to(device)
    slots[1::3] = -1  # padding rows among real ones: they must write nothing
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q, expected_residual = add_rms_norm_qkv_rotary_reference(
        x, res, norm_weight, EPS, weight, b, positions, cos, sin, expected_k, expected_v, slots,
        num_heads=num_heads, num_kv_heads=kv_heads,
    )  # fmt: skip
    copies = {"x": x.clone(), "residual": res.clone() if res is not None else None}

    q, new_residual = add_rms_norm_qkv_rotary(
        x, res, norm_weight, EPS, weight, b, positions, cos, sin, k_cache, v_cache, slots,
        num_heads=num_heads, num_kv_heads=kv_heads,
    )  # fmt: skip

    assert q.shape == (tokens, num_heads, head_dim) and q.dtype == dtype and q.is_contiguous()
    assert_gemm_close(q, expected_q)
    assert_close(new_residual, expected_residual)
    check_unchanged({"x": x, "residual": res}, copies)
    written = torch.zeros(pages * page_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    for cache, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        flat, flat_expected = cache.view(kv_heads, -1, head_dim), expected.view(kv_heads, -1, head_dim)
        assert (flat[:, ~written] == SENTINEL).all()
        assert_gemm_close(flat[:, written], flat_expected[:, written])


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_heads", "kv_heads", "head_dim", "residual", "bias"),
    [
        (3, 1, 32, True, False),  # GQA 3/1
        (2, 2, 32, False, True),  # no GQA, Qwen2's bias
        (4, 2, 16, True, True),  # the tiny test model's heads: a whole head per program
    ],
)
def test_qkv_rotary_matches_reference(tokens, dtype, num_heads, kv_heads, head_dim, residual, bias):
    check_qkv(tokens, 96, num_heads, kv_heads, head_dim, dtype, residual=residual, bias=bias)


def qkv_args(tokens=4, dtype=torch.bfloat16):
    x, res, norm_weight, weight, b, cos, sin, k_cache, v_cache = qkv_inputs(
        tokens, 96, 3, 1, 32, dtype, residual=True, bias=True, pages=2, page_size=4, device=DEVICE
    )
    return {
        "x": x,
        "residual": res,
        "norm_weight": norm_weight,
        "eps": EPS,
        "qkv_weight": weight,
        "qkv_bias": b,
        "positions": torch.arange(tokens, device=DEVICE),
        "cos": cos,
        "sin": sin,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": torch.arange(tokens, device=DEVICE),
        "num_heads": 3,
        "num_kv_heads": 1,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qk_norm": lambda _: True}, "qk_norm"),
        ({"x": lambda t: t[None]}, r"x must be \[tokens, hidden\]"),
        ({"x": lambda t: t.t().contiguous().t()}, "x's last dimension must be contiguous"),
        ({"residual": lambda t: t.float()}, "residual is"),
        ({"norm_weight": lambda t: t[:64]}, "norm_weight"),
        ({"norm_weight": lambda t: t.half()}, "norm_weight must be float32 or"),
        ({"qkv_weight": lambda t: t[:, :64]}, r"qkv_weight must be \[out_features, 96\]"),
        ({"qkv_weight": lambda t: t[:-32]}, "qkv_weight has 128 rows"),
        ({"qkv_weight": lambda t: t.half()}, "qkv_weight is torch.float16"),
        ({"qkv_bias": lambda t: t[:-1]}, "qkv_bias must be"),
        ({"num_kv_heads": lambda _: 2}, "positive multiple"),
        ({"k_cache": lambda t: t[:, :1]}, "k/v caches must both be"),
        ({"v_cache": lambda t: t.float()}, "v_cache is torch.float32"),
        ({"positions": lambda t: t.int()}, "positions must be int64"),
        ({"slot_mapping": lambda t: t[:-1]}, "slot_mapping must be int64 of shape"),
        ({"cos": lambda t: t.bfloat16()}, "cos must be float32"),
        ({"sin": lambda t: t[:, :16]}, "sin must be float32"),
    ],
)
def test_qkv_rotary_rejects_bad_inputs(change, message):
    args = qkv_args()
    args.update({name: make(args.get(name)) for name, make in change.items()})
    with pytest.raises(ValueError, match=message):
        add_rms_norm_qkv_rotary(**args)


def test_linear_and_gate_up_reject_bad_inputs():
    x, res, norm_weight = prologue_inputs(4, 96, torch.bfloat16)
    weight = linear_weight(80, 96, torch.bfloat16)
    with pytest.raises(ValueError, match="weight is torch.float32"):
        add_rms_norm_linear(x, res, norm_weight, EPS, weight.float())
    with pytest.raises(ValueError, match=r"bias must be \[80\]"):
        add_rms_norm_linear(x, res, norm_weight, EPS, weight, weight[0])
    with pytest.raises(ValueError, match="weight's last dimension must be contiguous"):
        add_rms_norm_linear(x, res, norm_weight, EPS, weight.t().contiguous().t())
    with pytest.raises(ValueError, match="out_dtype"):
        add_rms_norm_linear(x, res, norm_weight, EPS, weight, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        add_rms_norm_linear(x.double(), None, norm_weight, EPS, weight)
    with pytest.raises(ValueError, match="2 \\* intermediate rows"):
        add_rms_norm_gate_up_silu(x, res, norm_weight, EPS, weight[:79])
    with pytest.raises(ValueError, match="residual is"):
        add_rms_norm_gate_up_silu(x, res[:3], norm_weight, EPS, weight)


def test_empty_batches_launch_nothing():
    x, res, norm_weight = prologue_inputs(0, 96, torch.float32)
    weight = linear_weight(80, 96, torch.float32)
    assert add_rms_norm_linear(x, res, norm_weight, EPS, weight)[0].shape == (0, 80)
    assert add_rms_norm_gate_up_silu(x, res, norm_weight, EPS, weight)[0].shape == (0, 40)
    args = qkv_args(tokens=0, dtype=torch.float32)
    q, _ = add_rms_norm_qkv_rotary(**args)
    assert q.shape == (0, 3, 32) and (args["k_cache"] == SENTINEL).all()


def test_block_table_buckets():
    """Sorted buckets, tl.dot-sized tiles and one BLOCK_K (a row's sum of squares whatever the batch);
    the interpreter's table (INTERPRETER_BLOCKS as imported, before this file's fixture) is one bucket."""
    for kernel in BLOCKS:
        for table in (BLOCKS[kernel], INTERPRETER_BLOCKS[kernel]):
            limits = [most for most, _ in table]
            assert limits == sorted(limits), kernel
            for _, blocks in table:
                assert blocks.block_m >= 16 and blocks.block_k == 64, (kernel, blocks)
        assert len(INTERPRETER_BLOCKS[kernel]) == 1
    cuda = torch.device("cuda")
    assert blocks_for("linear", 1, cuda) == BLOCKS["linear"][0][1]
    assert blocks_for("linear", 10_000, cuda) == BLOCKS["linear"][-1][1]


# SmolLM2-135M's sizes on CUDA


SMOLLM2 = {"hidden": 576, "num_heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "vocab": 49152}
CUDA = torch.device("cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_smollm2_sizes_on_cuda(tokens, dtype):
    s = SMOLLM2
    torch.manual_seed(tokens)
    check_linear(
        tokens, s["hidden"], s["vocab"], dtype, residual=True, bias=False, out_dtype=torch.float32, device=CUDA
    )
    check_gate_up(tokens, s["hidden"], s["intermediate"], dtype, residual=True, device=CUDA)
    check_qkv(
        tokens, s["hidden"], s["num_heads"], s["kv_heads"], s["head_dim"], dtype,
        residual=True, bias=False, device=CUDA, pages=2 * tokens,
    )  # fmt: skip


@pytest.mark.gpu
@requires_cuda
def test_every_op_replays_in_a_cuda_graph():
    s, tokens, dtype = SMOLLM2, 64, torch.bfloat16
    torch.manual_seed(0)
    x, res, norm_weight, qkv_weight, _, cos, sin, k_cache, v_cache = qkv_inputs(
        tokens, s["hidden"], s["num_heads"], s["kv_heads"], s["head_dim"], dtype,
        residual=True, bias=False, pages=40, page_size=16, device=CUDA,
    )  # fmt: skip
    gate_up_weight = linear_weight(2 * s["intermediate"], s["hidden"], dtype, CUDA)
    lm_head = linear_weight(s["vocab"], s["hidden"], dtype, CUDA)
    positions = torch.zeros(tokens, dtype=torch.int64, device=CUDA)
    slots = torch.zeros(tokens, dtype=torch.int64, device=CUDA)
    heads = {"num_heads": s["num_heads"], "num_kv_heads": s["kv_heads"]}

    def step():
        q, after_attention = add_rms_norm_qkv_rotary(
            x, res, norm_weight, EPS, qkv_weight, None, positions, cos, sin, k_cache, v_cache, slots, **heads
        )
        activated, after_mlp = add_rms_norm_gate_up_silu(x, res, norm_weight, EPS, gate_up_weight)
        logits, _ = add_rms_norm_linear(x, None, norm_weight, EPS, lm_head, out_dtype=torch.float32)
        return q, after_attention, activated, after_mlp, logits

    step()  # compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    # Given new inputs in the captured buffers,
    for buffer in (x, res):
        buffer.copy_(torch.randn_like(buffer))
    positions.copy_(torch.randint(0, 4096, (tokens,), device=CUDA))
    slots.copy_(torch.randperm(40 * 16, device=CUDA)[:tokens])
    slots[-8:] = -1  # a graph bucket's padding rows
    k_cache.fill_(SENTINEL)
    v_cache.fill_(SENTINEL)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q, expected_residual = add_rms_norm_qkv_rotary_reference(
        x, res, norm_weight, EPS, qkv_weight, None, positions, cos, sin, expected_k, expected_v, slots, **heads
    )
    expected_activated, _ = add_rms_norm_gate_up_silu_reference(x, res, norm_weight, EPS, gate_up_weight)
    expected_logits, _ = add_rms_norm_linear_reference(x, None, norm_weight, EPS, lm_head, out_dtype=torch.float32)

    # when the graph replays,
    graph.replay()
    torch.cuda.synchronize()

    # then every output is computed from them.
    q, after_attention, activated, after_mlp, logits = outputs
    assert_gemm_close(q, expected_q)
    assert_close(after_attention, expected_residual)
    assert_close(after_mlp, expected_residual)
    assert_gemm_close(activated, expected_activated)
    assert_gemm_close(logits.to(dtype), expected_logits.to(dtype))
    assert_gemm_close(k_cache, expected_k)
    assert_gemm_close(v_cache, expected_v)
