"""The fused decoder-layer ops against their torch references.

Small cases run on CUDA when there is one, otherwise on the CPU through Triton's interpreter; the
gpu-marked tests repeat them at SmolLM2's sizes and replay every op in a CUDA graph.

Tolerances are two units in the last place of the output dtype: references and kernels round the
same float32 values, but rsqrt and exp may differ by a float32 ulp, which can flip a rounding, and
Triton 3.6's interpreter truncates float32 -> bfloat16 where CUDA rounds to nearest even.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.attention import write_kv  # noqa: E402
from kernels.fused import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rotary_and_cache_write,
    rotary_and_cache_write_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from workers.engine.config import RopeConfig  # noqa: E402
from workers.engine.layers.norm import RMSNorm  # noqa: E402
from workers.engine.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (2e-2, 1e-2)}
EPS = 1e-5
SENTINEL = -7.0  # what the caches hold before a write; exact in every dtype
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def randn(*shape: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


# RMSNorm


def check_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype, device=DEVICE) -> None:
    x = randn(tokens, hidden + 32, dtype=dtype, device=device)[:, :hidden]  # rows strided, as in a wider buffer
    weight = randn(hidden, dtype=weight_dtype, device=device)

    normed = rms_norm(x, weight, EPS)

    assert normed.dtype == dtype and normed.is_contiguous()
    assert_close(normed, rms_norm_reference(x, weight, EPS))


def check_fused_add_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, device=DEVICE) -> None:
    x, residual = randn(tokens, hidden, dtype=dtype, device=device), randn(tokens, hidden, dtype=dtype, device=device)
    weight = randn(hidden, dtype=dtype, device=device)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)

    normed = fused_add_rms_norm(x, residual, weight, EPS)

    assert normed is x
    assert_close(residual, expected_residual)
    assert_close(normed, expected_normed)


@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rms_norm_matches_reference(hidden, dtype, fp32_weight):
    check_rms_norm(5, hidden, dtype, torch.float32 if fp32_weight else dtype)


def test_float32_rms_norm_matches_the_model_layer():
    layer = RMSNorm(96, EPS).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_()
    x = randn(4, 96, dtype=torch.float32)
    assert_close(rms_norm(x, layer.weight.detach(), EPS), layer(x).detach())


def test_rms_norm_writes_into_out():
    x, weight = randn(3, 96, dtype=torch.bfloat16), randn(96, dtype=torch.bfloat16)
    out = torch.zeros(3, 128, dtype=torch.bfloat16, device=DEVICE)[:, :96]

    result = rms_norm(x, weight, EPS, out=out)

    assert result is out
    assert_close(out, rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_updates_both_in_place(hidden, dtype):
    check_fused_add_rms_norm(5, hidden, dtype)


# Triton's interpreter truncates float32 -> bfloat16, so only CUDA rounds bfloat16 sums as torch does.
@pytest.mark.parametrize("dtype", DTYPES if DEVICE.type == "cuda" else DTYPES[:2], ids=str)
def test_fused_add_rms_norm_is_bitwise_the_unfused_ops(dtype):
    x, residual = randn(5, 576, dtype=dtype), randn(5, 576, dtype=dtype)
    weight = randn(576, dtype=dtype)
    summed = x + residual
    expected = rms_norm(summed, weight, EPS)

    normed = fused_add_rms_norm(x, residual, weight, EPS)

    assert torch.equal(residual, summed)
    assert torch.equal(normed, expected)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda x, w: (x, w[:64]), "weight"),
        (lambda x, w: (x, w.half()), "weight must be float32 or"),
        (lambda x, w: (x.t(), w), "last dimension must be contiguous"),
        (lambda x, w: (x[None], w), r"\[tokens, hidden\]"),
        (lambda x, w: (x.to(torch.int32), w), "float32, float16 or bfloat16"),
    ],
)
def test_rms_norm_rejects_bad_inputs(make, message):
    x, weight = make(randn(96, 96, dtype=torch.bfloat16), randn(96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=message):
        rms_norm(x, weight, EPS)


def test_fused_add_rms_norm_rejects_bad_inputs():
    x, weight = randn(4, 96, dtype=torch.bfloat16), randn(96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x.float(), weight, EPS)
    with pytest.raises(ValueError, match="different tensors"):
        fused_add_rms_norm(x, x, weight, EPS)


# Rotary + KV-cache write


def rotary_inputs(tokens, num_heads, kv_heads, head_dim, dtype, *, pages, page_size, device=DEVICE):
    """qk and v as views into one fused qkv output, the model's rotation tables, poisoned caches."""
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    qkv = qkv.view(tokens, num_heads + 2 * kv_heads, head_dim)
    qk, v = qkv[:, : num_heads + kv_heads], qkv[:, num_heads + kv_heads :]
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, max_positions=4096).to(device)
    k_cache = torch.full((kv_heads, pages, page_size, head_dim), SENTINEL, dtype=dtype, device=device)
    return qk, v, rotary.cos, rotary.sin, k_cache, k_cache.clone()


def check_rotary(qk, v, positions, cos, sin, k_cache, v_cache, slots, num_heads):
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = rotary_and_cache_write_reference(
        qk, v, positions, cos, sin, expected_k, expected_v, slots, num_heads=num_heads
    )

    q = rotary_and_cache_write(qk, v, positions, cos, sin, k_cache, v_cache, slots, num_heads=num_heads)

    assert q.shape == (qk.shape[0], num_heads, qk.shape[2]) and q.is_contiguous()
    assert_close(q, expected_q)
    assert_close(k_cache, expected_k)
    assert_close(v_cache, expected_v)
    kv_heads, pages, page_size, head_dim = k_cache.shape
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device=k_cache.device)
    untouched[slots[slots >= 0]] = False
    for cache in (k_cache, v_cache):
        assert (cache.view(kv_heads, -1, head_dim)[:, untouched] == SENTINEL).all()


# Page size 4, block table [3, 1, 5]: a 10-token prompt crosses two page boundaries, then one decode
# token in page 2 and two padding rows that must write nothing.
PAGE_SIZE, PAGES = 4, 6
SLOTS = [12, 13, 14, 15, 4, 5, 6, 7, 20, 21, 9, -1, -1]
POSITIONS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 0, 0]


@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), [(3, 1, 64), (4, 2, 96)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_cache_write_matches_reference(num_heads, kv_heads, head_dim, dtype):
    qk, v, cos, sin, k_cache, v_cache = rotary_inputs(
        len(SLOTS), num_heads, kv_heads, head_dim, dtype, pages=PAGES, page_size=PAGE_SIZE
    )
    positions = torch.tensor(POSITIONS, device=DEVICE)
    slots = torch.tensor(SLOTS, device=DEVICE)
    check_rotary(qk, v, positions, cos, sin, k_cache, v_cache, slots, num_heads)


def test_float32_rotary_matches_the_model_layer():
    qk, v, cos, sin, k_cache, v_cache = rotary_inputs(10, 3, 1, 64, torch.float32, pages=PAGES, page_size=PAGE_SIZE)
    positions, slots = torch.tensor(POSITIONS[:10], device=DEVICE), torch.tensor(SLOTS[:10], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = apply_rotary(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)).split([3, 1], dim=1)
    write_kv(expected_k, expected_v, k_ref, v, slots)

    q = rotary_and_cache_write(qk, v, positions, cos, sin, k_cache, v_cache, slots, num_heads=3)

    assert_close(q, q_ref)
    assert_close(k_cache, expected_k)
    assert_close(v_cache, expected_v)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"positions": lambda t: t.int()}, "positions must be int64"),
        ({"slot_mapping": lambda t: t[:-1]}, "slot_mapping must be int64 of shape"),
        ({"v": lambda t: t[:, :, :32]}, "v must be"),
        ({"qk": lambda t: torch.cat([t, t], dim=-1)[..., ::2]}, "qk's last dimension must be contiguous"),
        ({"k_cache": lambda t: t.float()}, "k_cache is torch.float32"),
        ({"v_cache": lambda t: t[:, :, :2]}, "k/v caches must both be"),
        ({"cos": lambda t: t.bfloat16()}, "cos must be float32"),
        ({"sin": lambda t: t[:, :32]}, "sin must be float32"),
        ({"num_heads": lambda n: 4}, "num_heads 4 leaves no"),
    ],
)
def test_rotary_and_cache_write_rejects_bad_inputs(change, message):
    qk, v, cos, sin, k_cache, v_cache = rotary_inputs(4, 3, 1, 64, torch.bfloat16, pages=2, page_size=4)
    args = {
        "qk": qk,
        "v": v,
        "positions": torch.arange(4, device=DEVICE),
        "cos": cos,
        "sin": sin,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": torch.arange(4, device=DEVICE),
        "num_heads": 3,
    }
    args.update({name: make(args[name]) for name, make in change.items()})
    with pytest.raises(ValueError, match=message):
        rotary_and_cache_write(**args)


# SiLU and mul


def check_silu_and_mul(tokens: int, intermediate: int, dtype: torch.dtype, device=DEVICE) -> None:
    gate_up = randn(tokens, 2 * intermediate + 16, dtype=dtype, device=device)[:, : 2 * intermediate]

    out = silu_and_mul(gate_up)

    assert out.shape == (tokens, intermediate) and out.dtype == dtype
    assert_close(out, silu_and_mul_reference(gate_up))


@pytest.mark.parametrize("intermediate", [96, 1536])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_reference(intermediate, dtype):
    check_silu_and_mul(3, intermediate, dtype)


def test_silu_and_mul_writes_into_out():
    gate_up = randn(3, 192, dtype=torch.float32)
    out = torch.zeros(3, 128, device=DEVICE)[:, :96]

    assert silu_and_mul(gate_up, out=out) is out
    assert_close(out, silu_and_mul_reference(gate_up))


def test_silu_and_mul_rejects_bad_inputs():
    gate_up = randn(3, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[tokens, 2 \* intermediate\]"):
        silu_and_mul(gate_up[:, :191])
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        silu_and_mul(randn(192, 3, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(gate_up, out=torch.empty(3, 96, device=DEVICE))


def test_empty_batches_launch_nothing():
    weight = randn(96, dtype=torch.float32)
    assert rms_norm(randn(0, 96, dtype=torch.float32), weight, EPS).shape == (0, 96)
    assert silu_and_mul(randn(0, 192, dtype=torch.float32)).shape == (0, 96)
    qk, v, cos, sin, k_cache, v_cache = rotary_inputs(0, 3, 1, 64, torch.float32, pages=2, page_size=4)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert rotary_and_cache_write(qk, v, empty, cos, sin, k_cache, v_cache, empty, num_heads=3).shape == (0, 3, 64)
    assert (k_cache == SENTINEL).all()


# SmolLM2-135M's sizes on CUDA, bfloat16


SMOLLM2 = {"hidden": 576, "num_heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "tokens": 256}
CUDA = torch.device("cuda")


def smollm2_rotary_inputs():
    s = SMOLLM2
    qk, v, cos, sin, k_cache, v_cache = rotary_inputs(
        s["tokens"], s["num_heads"], s["kv_heads"], s["head_dim"], torch.bfloat16, pages=40, page_size=16, device=CUDA
    )
    positions = torch.randint(0, 4096, (s["tokens"],), device=CUDA)
    slots = torch.randperm(40 * 16, device=CUDA)[: s["tokens"]]
    slots[-10:] = -1  # a graph bucket's padding rows
    return qk, v, positions, cos, sin, k_cache, v_cache, slots


@pytest.mark.gpu
@requires_cuda
def test_smollm2_sizes_on_cuda():
    s = SMOLLM2
    torch.manual_seed(0)
    for weight_dtype in (torch.bfloat16, torch.float32):
        check_rms_norm(s["tokens"], s["hidden"], torch.bfloat16, weight_dtype, device=CUDA)
    check_fused_add_rms_norm(s["tokens"], s["hidden"], torch.bfloat16, device=CUDA)
    check_rotary(*smollm2_rotary_inputs(), s["num_heads"])
    check_silu_and_mul(s["tokens"], s["intermediate"], torch.bfloat16, device=CUDA)


@pytest.mark.gpu
@requires_cuda
def test_every_op_replays_in_a_cuda_graph():
    s = SMOLLM2
    torch.manual_seed(0)
    x, added_x, residual = (randn(s["tokens"], s["hidden"], dtype=torch.bfloat16, device=CUDA) for _ in range(3))
    weight = randn(s["hidden"], dtype=torch.bfloat16, device=CUDA)
    qk, v, positions, cos, sin, k_cache, v_cache, slots = smollm2_rotary_inputs()
    gate_up = randn(s["tokens"], 2 * s["intermediate"], dtype=torch.bfloat16, device=CUDA)

    def step():
        normed = rms_norm(x, weight, EPS)
        added = fused_add_rms_norm(added_x, residual, weight, EPS)
        q = rotary_and_cache_write(qk, v, positions, cos, sin, k_cache, v_cache, slots, num_heads=s["num_heads"])
        return normed, added, q, silu_and_mul(gate_up)

    step()  # compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, added, q, activated = step()

    # Given new inputs in the captured buffers,
    fresh_qk, fresh_v, fresh_positions, _, _, _, _, fresh_slots = smollm2_rotary_inputs()
    for buffer, value in ((qk, fresh_qk), (v, fresh_v), (positions, fresh_positions), (slots, fresh_slots)):
        buffer.copy_(value)
    for buffer in (x, added_x, residual, gate_up):
        buffer.copy_(torch.randn_like(buffer))
    k_cache.fill_(SENTINEL)
    v_cache.fill_(SENTINEL)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_added, expected_residual = fused_add_rms_norm_reference(added_x, residual, weight, EPS)
    expected_q = rotary_and_cache_write_reference(
        qk, v, positions, cos, sin, expected_k, expected_v, slots, num_heads=s["num_heads"]
    )

    # when the graph replays,
    graph.replay()
    torch.cuda.synchronize()

    # then every output is computed from them.
    assert_close(normed, rms_norm_reference(x, weight, EPS))
    assert_close(added, expected_added)
    assert_close(residual, expected_residual)
    assert_close(q, expected_q)
    assert_close(k_cache, expected_k)
    assert_close(v_cache, expected_v)
    assert_close(activated, silu_and_mul_reference(gate_up))
