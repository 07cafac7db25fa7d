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


def experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """[T, H] in hidden's dtype: sum over k of topk_weights[t, k] * expert(topk_slots[t, k])(hidden[t])."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    held = topk_slots[topk_slots >= 0]
    for slot in held.unique().tolist():
        token, choice = (topk_slots == slot).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[token], w13[slot]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[slot])
        out.index_add_(0, token, expert_out.float() * topk_weights[token, choice, None])
    return out.to(hidden.dtype)
