"""Mixture-of-experts expert FFNs: tokens routed to k of S expert slots, SiLU-gated.

`experts` is the checked entry point the model calls: the Triton grouped GEMMs (`fused.py`) on
CUDA, the per-expert torch loop (`reference.py`) elsewhere. Triton is imported only when used.
"""

import functools
import importlib
import importlib.util
from types import ModuleType

import torch

from kernels.moe.checks import check_experts_inputs
from kernels.moe.reference import experts_reference
from kernels.moe.scales import block_scales


@functools.cache
def _fused() -> ModuleType:
    return importlib.import_module("kernels.moe.fused")


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernels, checked (on CPU tensors they run under TRITON_INTERPRET=1)."""
    scales = block_scales(w13_scale_inv, w2_scale_inv, block)
    return _fused().fused_experts(hidden, w13, w2, topk_slots, topk_weights, scales)


def experts(
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
    """[T, H]: the weighted sum over each token's k slots of the SiLU-gated expert FFNs (see
    reference.py for the layout). FP8 experts: w13 and w2 in e4m3 with their block scales
    (kernels.moe.scales); off CUDA they are held dequantized, and `activation_group` quantizes the
    activations as the FP8 kernels do. On CUDA with Triton no host syncs, so CUDA graphs can capture it."""
    scales = block_scales(w13_scale_inv, w2_scale_inv, block)
    if hidden.device.type == "cuda" and _has_triton():
        return _fused().fused_experts(hidden, w13, w2, topk_slots, topk_weights, scales)
    check_experts_inputs(hidden, w13, w2, topk_slots, topk_weights, scales)
    return experts_reference(
        hidden,
        w13,
        w2,
        topk_slots,
        topk_weights,
        w13_scale_inv=w13_scale_inv,
        w2_scale_inv=w2_scale_inv,
        block=block,
        activation_group=activation_group,
    )


__all__ = ["experts", "experts_reference", "fused_experts"]
