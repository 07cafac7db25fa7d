"""Mixture-of-experts expert FFNs: tokens routed to k of S expert slots, SiLU-gated.

`experts` is the checked entry point the model calls; the per-expert torch loop (`reference.py`)
computes it.
"""

import torch

from kernels.moe.checks import check_experts_inputs
from kernels.moe.reference import experts_reference


def experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """[T, H]: the weighted sum over each token's k slots of the SiLU-gated expert FFNs (see
    reference.py for the layout)."""
    check_experts_inputs(hidden, w13, w2, topk_slots, topk_weights)
    return experts_reference(hidden, w13, w2, topk_slots, topk_weights)


__all__ = ["experts", "experts_reference"]
