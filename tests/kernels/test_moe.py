"""The MoE expert ops: the per-expert reference against a per-token computation, the Triton
grouped GEMMs against the reference (on CUDA when there is one, else on the CPU under Triton's
interpreter at small sizes; the gpu-marked tests at a Qwen3-30B-A3B layer's sizes and in a CUDA
graph), and the checked entry points' refusals.

Tolerances: float32 is exact up to summation order. In bfloat16 the reference rounds gate and up
to bfloat16 before silu(gate) * up and the kernel does not, a few bfloat16 ulps.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.moe import experts, experts_reference, fused_experts  # noqa: E402
from kernels.moe.configs import DIRECT, DIRECT_MAX_PAIRS, tile_config  # noqa: E402
from kernels.moe.direct import direct_experts  # noqa: E402
from kernels.moe.fused import aligned_experts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_inputs(
    tokens=13, hidden=32, intermediate=24, slots=6, k=3, dtype=torch.float32, seed=0, device=torch.device("cpu")
):
    generator = torch.Generator().manual_seed(seed)
    scale = hidden**-0.5
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w13 = (torch.randn(slots, 2 * intermediate, hidden, generator=generator) * scale).to(dtype)
    w2 = (torch.randn(slots, hidden, intermediate, generator=generator) * intermediate**-0.5).to(dtype)
    # k distinct slots per token, then about one in four marked "not here" (-1).
    ids = torch.rand(tokens, slots, generator=generator).argsort(dim=-1)[:, :k]
    ids[torch.rand(tokens, k, generator=generator) < 0.25] = -1
    weights = torch.rand(tokens, k, generator=generator)
    return tuple(tensor.to(device) for tensor in (x, w13, w2, ids, weights))


def per_token(x, w13, w2, ids, weights):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, weight in zip(ids[t].tolist(), weights[t].tolist()):
            if slot >= 0:
                gate, up = (w13[slot] @ x[t]).chunk(2)
                out[t] += weight * (w2[slot] @ (F.silu(gate) * up))
    return out


def test_reference_is_the_weighted_sum_over_held_slots():
    inputs = make_inputs()
    torch.testing.assert_close(experts_reference(*inputs), per_token(*inputs), atol=1e-5, rtol=1e-5)


def test_tokens_routed_nowhere_here_get_zero():
    x, w13, w2, ids, weights = make_inputs()
    ids[:4] = -1
    out = experts(x, w13, w2, ids, weights)
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert out[4:].abs().sum() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda i: {**i, "x": i["x"][None]}, "hidden must be"),
        (lambda i: {**i, "w13": i["w13"][:, :-1]}, "w13 must be"),
        (lambda i: {**i, "w2": i["w2"][:-1]}, "w2 must be"),
        (lambda i: {**i, "w2": i["w2"].double()}, "w2 must be torch.float32"),
        (lambda i: {**i, "ids": i["ids"].int()}, "topk_slots must be int64"),
        (lambda i: {**i, "ids": i["ids"][:-1]}, "topk_slots must be"),
        (lambda i: {**i, "weights": i["weights"].half()}, "topk_weights must be float32"),
        (lambda i: {**i, "weights": i["weights"][:, :1]}, "topk_weights must be"),
        (lambda i: {**i, "ids": i["ids"].clamp(min=0) + 5}, r"topk_slots must be in \[-1, 6\)"),
        (lambda i: {**i, "ids": i["ids"].clamp(max=0) - 1}, r"topk_slots must be in \[-1, 6\)"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    x, w13, w2, ids, weights = make_inputs()
    bad = change({"x": x, "w13": w13, "w2": w2, "ids": ids, "weights": weights})
    with pytest.raises(ValueError, match=message):
        experts(bad["x"], bad["w13"], bad["w2"], bad["ids"], bad["weights"])


# The Triton kernels.


def test_align_pairs_gives_each_slot_whole_tiles():
    from kernels.moe.fused import align_pairs

    slots, block_m = 5, 4
    ids = torch.tensor([[0, 3], [3, -1], [0, 3], [-1, -1], [4, 0], [3, 3]])
    sorted_pairs, tile_slots = align_pairs(ids, slots, block_m)
    flat = ids.reshape(-1).tolist()
    # Slot 0: pairs 0, 4, 9; slot 3: 1, 2, 5, 10, 11 (two tiles); slot 4: 8; then empty tiles.
    assert tile_slots.tolist()[:4] == [0, 3, 3, 4] and set(tile_slots.tolist()[4:]) == {slots}
    tiles = sorted_pairs.view(-1, block_m).tolist()
    assert tiles[:4] == [[0, 4, 9, 12], [1, 2, 5, 10], [11, 12, 12, 12], [8, 12, 12, 12]]
    held = [pair for pair, slot in enumerate(flat) if slot >= 0]
    assert sorted(p for p in sorted_pairs.tolist() if p < len(flat)) == held
    assert sorted_pairs.numel() == -(-(len(flat) + slots * (block_m - 1)) // block_m) * block_m


@pytest.mark.parametrize(
    "dtype, tokens, slots, direct",
    [
        (torch.float32, 1, 6, True),  # the direct path: no sort, one tile per slot
        (torch.bfloat16, 2, 6, True),
        (torch.float32, 8, 6, True),
        (torch.bfloat16, 40, 6, True),  # a slot's pairs fill several tiles
        (torch.float32, 90, 18, False),  # aligned, 16-row tiles; columns and depth not multiples of the blocks
        (torch.bfloat16, 100, 12, False),  # aligned, 32-row tiles
        (torch.float32, 100, 6, False),  # aligned, 64-row tiles
    ],
)
def test_fused_experts_equals_the_reference(dtype, tokens, slots, direct):
    inputs = make_inputs(tokens=tokens, slots=slots, dtype=dtype, device=DEVICE)
    assert tile_config(inputs[3].numel(), inputs[1].shape[0]).direct == direct
    out = fused_experts(*inputs)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    torch.testing.assert_close(out, experts_reference(*inputs), **TOLERANCE[dtype])


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_direct_path_equals_the_aligned_path(tokens):
    x, w13, w2, ids, weights = make_inputs(tokens=tokens, device=DEVICE)
    ids = ids.contiguous()
    torch.testing.assert_close(
        direct_experts(x, w13, w2, ids, weights), aligned_experts(x, w13, w2, ids, weights), atol=1e-5, rtol=1e-5
    )


def test_direct_path_takes_a_slot_named_more_times_than_a_tile_has_rows():
    # 8 tokens naming slot 2 three times each: 24 pairs of one slot, two 16-row tiles.
    x, w13, w2, ids, weights = make_inputs(tokens=8, device=DEVICE)
    ids = torch.full_like(ids, 2)
    ids[3, 1] = -1
    assert DIRECT.block_m < ids.numel() <= DIRECT_MAX_PAIRS
    torch.testing.assert_close(fused_experts(x, w13, w2, ids, weights), experts_reference(x, w13, w2, ids, weights))


def test_fused_experts_with_every_pair_elsewhere_or_no_tokens():
    x, w13, w2, ids, weights = make_inputs(tokens=5, device=DEVICE)
    assert torch.equal(fused_experts(x, w13, w2, torch.full_like(ids, -1), weights), torch.zeros_like(x))
    assert fused_experts(x[:0], w13, w2, ids[:0], weights[:0]).shape == (0, x.shape[1])


def test_fused_experts_refuses_bad_inputs():
    x, w13, w2, ids, weights = make_inputs(tokens=5)
    with pytest.raises(ValueError, match=r"topk_slots must be in \[-1, 6\)"):
        fused_experts(x, w13, w2, ids.clamp(min=0) + 6, weights)
    with pytest.raises(ValueError, match="w2 must be torch.float32"):
        fused_experts(x, w13, w2.bfloat16(), ids, weights)


# On the accelerator machine: a Qwen3-30B-A3B layer (128 experts, top-8, hidden 2048, intermediate 768).


@pytest.fixture(scope="module")
def qwen3_30b_weights():
    generator = torch.Generator(DEVICE).manual_seed(0)
    w13 = torch.randn(128, 2 * 768, 2048, device=DEVICE, generator=generator) * 2048**-0.5
    w2 = torch.randn(128, 2048, 768, device=DEVICE, generator=generator) * 768**-0.5
    return w13.bfloat16(), w2.bfloat16()


def qwen3_30b_routing(tokens: int, seed: int):
    """Hidden states and softmax top-8 routing; one pair in ten held elsewhere (-1)."""
    generator = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(tokens, 2048, device=DEVICE, generator=generator).bfloat16()
    logits = torch.randn(tokens, 128, device=DEVICE, generator=generator)
    weights, ids = logits.softmax(dim=-1).topk(8, dim=-1)
    elsewhere = torch.rand(tokens, 8, device=DEVICE, generator=generator) < 0.1
    return x, ids.masked_fill(elsewhere, -1), weights


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [1, 2, 8, 16, 64, 512, 4096])
def test_gpu_fused_experts_at_qwen3_30b_sizes(qwen3_30b_weights, tokens):
    w13, w2 = qwen3_30b_weights
    x, ids, weights = qwen3_30b_routing(tokens, seed=tokens)
    out = fused_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(out, experts_reference(x, w13, w2, ids, weights), **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gpu_direct_path_equals_the_aligned_path_at_qwen3_30b_sizes(qwen3_30b_weights, tokens):
    w13, w2 = qwen3_30b_weights
    x, ids, weights = qwen3_30b_routing(tokens, seed=tokens)
    assert tile_config(ids.numel(), w13.shape[0]).direct
    direct = direct_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(direct, aligned_experts(x, w13, w2, ids, weights), **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_fused_experts_replays_in_a_cuda_graph(qwen3_30b_weights, tokens):
    w13, w2 = qwen3_30b_weights
    x, ids, weights = qwen3_30b_routing(tokens, seed=0)
    experts(x, w13, w2, ids, weights)  # compiles the kernels outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, w13, w2, ids, weights)
    for seed in (1, 2):
        for static, new in zip((x, ids, weights), qwen3_30b_routing(tokens, seed=seed)):
            static.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, experts_reference(x, w13, w2, ids, weights), **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [8, 100])  # the direct path, the aligned one
def test_gpu_slots_out_of_range_are_not_read(tokens):
    # On CUDA the wrapper does not read slot values (a host sync); the kernels skip any slot outside
    # [0, S), so a bad id costs that pair, never a read past the weights.
    x, w13, w2, ids, weights = make_inputs(tokens=tokens, dtype=torch.bfloat16, device=DEVICE)
    bad = ids.clone()
    bad[:, 0] = 1000
    expected = experts_reference(x, w13, w2, torch.where(bad == 1000, -1, bad), weights)
    torch.testing.assert_close(fused_experts(x, w13, w2, bad, weights), expected, **TOLERANCE[torch.bfloat16])
