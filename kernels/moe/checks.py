"""Input checks shared by the MoE expert ops: shapes, dtypes and devices always (metadata, no device
work); slot values only for CPU tensors, since reading them on CUDA would be a host sync in the
decode step. The Triton kernel treats a slot outside [0, S) as not held, so it never reads past
the weights whatever the ids."""

import torch

from kernels.moe.scales import BlockScales
from kernels.quant.fp8_blocks import FP8, block_grid, check_block

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_experts_inputs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    scales: BlockScales | None = None,
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden must be float32, float16 or bfloat16, got {hidden.dtype}")
    tokens, hidden_size = hidden.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden_size:
        raise ValueError(f"w13 must be [slots, 2 * intermediate, {hidden_size}], got shape {tuple(w13.shape)}")
    slots, intermediate = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (slots, hidden_size, intermediate):
        raise ValueError(f"w2 must be {(slots, hidden_size, intermediate)} to match w13, got {tuple(w2.shape)}")
    weight_dtype = hidden.dtype if scales is None else FP8
    for name, weight in (("w13", w13), ("w2", w2)):
        if weight.dtype != weight_dtype or weight.device != hidden.device:
            like = "like hidden" if scales is None else "(FP8 experts: scales given)"
            raise ValueError(
                f"{name} must be {weight_dtype} on {hidden.device} {like}, got {weight.dtype} on {weight.device}"
            )
        if weight.stride(2) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {weight.stride()}")
    if hidden.stride(1) != 1:
        raise ValueError(f"hidden's last dimension must be contiguous, got strides {hidden.stride()}")
    if topk_slots.dim() != 2 or topk_slots.shape[0] != tokens or topk_slots.shape[1] < 1:
        raise ValueError(f"topk_slots must be [{tokens}, k] with k >= 1, got shape {tuple(topk_slots.shape)}")
    if topk_slots.dtype != torch.int64:
        raise ValueError(f"topk_slots must be int64, got {topk_slots.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_slots.shape):
        raise ValueError(
            f"topk_weights must be {tuple(topk_slots.shape)} like topk_slots, got {tuple(topk_weights.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    for name, tensor in (("topk_slots", topk_slots), ("topk_weights", topk_weights)):
        if tensor.device != hidden.device:
            raise ValueError(f"{name} must be on {hidden.device} like hidden, got {tensor.device}")
    if topk_slots.device.type == "cpu" and topk_slots.numel():
        low, high = int(topk_slots.min()), int(topk_slots.max())
        if low < -1 or high >= slots:
            raise ValueError(f"topk_slots must be in [-1, {slots}) (-1: not held here), got values in [{low}, {high}]")
    if scales is not None:
        check_block_scales(scales, w13, w2)


def check_block_scales(scales: BlockScales, w13: torch.Tensor, w2: torch.Tensor) -> None:
    check_block(scales.block)
    slots = w13.shape[0]
    for name, scale_inv, weight in (("w13_scale_inv", scales.w13, w13), ("w2_scale_inv", scales.w2, w2)):
        expected = (slots, *block_grid(tuple(weight.shape[1:]), scales.block))
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
            raise ValueError(
                f"{name} must be float32 {expected} (one per {scales.block} tile of each slot's "
                f"{tuple(weight.shape[1:])}), got {scale_inv.dtype} of shape {tuple(scale_inv.shape)}"
            )
        if scale_inv.device != weight.device:
            raise ValueError(f"{name} must be on {weight.device} like the weights, got {scale_inv.device}")
