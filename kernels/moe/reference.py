"""The per-expert torch loop that the fused MoE kernel is tested against.

Experts are held in slots: w13[s] is slot s's gate rows then up rows ([2 * I, H]), w2[s] its down
projection ([H, I]). Each token names k slots with a weight each; a slot of -1 means the expert is
not held here and contributes nothing (expert parallelism routes it elsewhere). Slots are visited in
ascending order and each one's contribution is added in float32, so a token's sum runs in the order
HF's loop adds it. The loop reads routing on the host (`unique`, `nonzero`): a reference, not a
CUDA-graph path.
"""

import torch
import torch.nn.functional as F

from kernels.quant.fp8_blocks import dequantized_w8a8, w8a8_block_matmul_reference


def experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    activation_group: int | None = None,
) -> torch.Tensor:
    """[T, H] in hidden's dtype: sum over k of topk_weights[t, k] * expert(topk_slots[t, k])(hidden[t]).
    With block and the scales, w13 and w2 are e4m3 (kernels.moe.scales) and each expert's two
    GEMMs compute what the FP8 kernels do (w8a8_block_matmul_reference): activations quantized per
    token and group of block_k channels, weights dequantized. `activation_group` (no scales): the
    weights are FP8 experts' already dequantized (off CUDA), and the activations are quantized in
    groups of that many channels all the same."""

    def linear(x: torch.Tensor, weights: torch.Tensor, scale_inv: torch.Tensor | None, slot: int) -> torch.Tensor:
        if scale_inv is not None:
            return w8a8_block_matmul_reference(x, weights[slot], scale_inv[slot], block)
        if activation_group is not None:
            return dequantized_w8a8(x, weights[slot], activation_group, None)
        return F.linear(x, weights[slot])

    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    held = topk_slots[topk_slots >= 0]
    for slot in held.unique().tolist():
        token, choice = (topk_slots == slot).nonzero(as_tuple=True)
        gate, up = linear(hidden[token], w13, w13_scale_inv, slot).chunk(2, dim=-1)
        expert_out = linear(F.silu(gate) * up, w2, w2_scale_inv, slot)
        out.index_add_(0, token, expert_out.float() * topk_weights[token, choice, None])
    return out.to(hidden.dtype)
