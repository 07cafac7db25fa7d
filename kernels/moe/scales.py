"""FP8 experts: e4m3 w13 and w2 come with one float32 scale_inv per (block_n, block_k) tile of each
slot's matrix, the layout kernels.quant.fp8_blocks.quantize_weight_blocks gives stacked experts:
w13's [S, ceil(2I / block_n), ceil(H / block_k)] and w2's [S, ceil(H / block_n), ceil(I / block_k)].
The activations are quantized on the fly, per token and group of block_k channels."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockScales:
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int]


def block_scales(
    w13_scale_inv: torch.Tensor | None, w2_scale_inv: torch.Tensor | None, block: tuple[int, int] | None
) -> BlockScales | None:
    """The FP8 scales if given (all three or none), else None: the weights are in hidden's dtype."""
    given = {"w13_scale_inv": w13_scale_inv, "w2_scale_inv": w2_scale_inv, "block": block}
    if all(value is None for value in given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"FP8 experts need w13_scale_inv, w2_scale_inv and block together; missing {missing}")
    return BlockScales(w13_scale_inv, w2_scale_inv, tuple(block))


def scale_args(scale_inv: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int, int]:
    """A GEMM kernel's scale arguments: the slot-stacked scale_inv and its three strides, or none
    (the kernel's FP8 branch is compiled out) for weights in hidden's dtype."""
    if scale_inv is None:
        return None, 0, 0, 0
    return scale_inv, *scale_inv.stride()
