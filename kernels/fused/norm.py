"""RMSNorm, alone and fused with the residual add before it, as Triton kernels with torch references.

Per row of x ([T, hidden]), in float32:

    normed = round(x * rsqrt(mean(x²) + eps))      round: to x's dtype
    out    = round(weight * normed)

which is HF Llama's formula (workers/engine/layers/norm.py): low-precision inputs are normalized in
float32, rounded, and scaled in the input dtype. For float32 inputs the roundings are no-ops and it
is F.rms_norm's formula. A float32 weight with a low-precision x gives x's dtype here, where the
layer's `weight * x` would promote to float32.

`fused_add_rms_norm` first forms `residual = round(x + residual)` (x's dtype, the model's
`hidden + attn_out`), stores it back into `residual`, normalizes that rounded sum, and writes the
result into `x`: both tensors are updated in place, as vLLM does, and `x` is returned.

Grid: (T,), one program per row; the program holds the whole row in one block (the next power of
two >= hidden, masked), so hidden is capped at MAX_HIDDEN. Launch-only wrappers (no host syncs, grid
from shapes) are safe to capture in a CUDA graph once a first call has compiled the kernel.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_prologue

MAX_HIDDEN = 65536  # one row must fit one program's block
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model layer's formula, with the result always in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual), leaving the inputs untouched."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x ([T, hidden]) into `out` (a new [T, hidden] tensor if None; may be x).

    Rows of x and out may be strided; their last dimension must be contiguous."""
    _check_rows("x", x)
    _check_weight(weight, x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        _check_rows("out", out)
        _check_like("out", out, x)
    block, num_warps = _block(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x.stride(0),
        weight,
        out,
        out.stride(0),
        x.shape[1],
        eps,
        BLOCK=block,
        **launch_options(x.device),
        num_warps=num_warps,
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, x's dtype); x = RMSNorm(residual) (in place); returns x."""
    _check_rows("x", x)
    _check_rows("residual", residual)
    _check_like("residual", residual, x)
    if residual.data_ptr() == x.data_ptr():
        raise ValueError("x and residual must be different tensors: both are written in place")
    _check_weight(weight, x)
    block, num_warps = _block(x.shape[1])
    _fused_add_rms_norm_kernel[(x.shape[0],)](
        x,
        x.stride(0),
        residual,
        residual.stride(0),
        weight,
        x.shape[1],
        eps,
        BLOCK=block,
        **launch_options(x.device),
        num_warps=num_warps,
    )
    return x


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [tokens, hidden], got shape {tuple(tensor.shape)}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.stride(1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous, got strides {tensor.stride()}")
    if tensor.shape[1] > MAX_HIDDEN:
        raise ValueError(f"{name} has hidden size {tensor.shape[1]}, more than one block holds ({MAX_HIDDEN})")


def _check_like(name: str, tensor: torch.Tensor, x: torch.Tensor) -> None:
    if tensor.shape != x.shape or tensor.dtype != x.dtype or tensor.device != x.device:
        raise ValueError(
            f"{name} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
            f"x is {tuple(x.shape)} {x.dtype} on {x.device}"
        )


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {x.shape[1]}")
    if weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"weight must be float32 or x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")


def _block(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 256, 1), 8)


@triton.jit
def _scaled_norm(x, w_ptr, cols, mask, hidden, eps, out_dtype: tl.constexpr):
    """weight * round(x * rsqrt(mean(x²) + eps)), rounded; x is the float32 row (0 past hidden)."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(out_dtype).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (weight * normed).to(out_dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_row_stride, w_ptr, out_ptr, out_row_stride, hidden, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)  # kernels.pdl
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = _scaled_norm(x, w_ptr, cols, mask, hidden, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, x_row_stride, res_ptr, res_row_stride, w_ptr, hidden, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)  # kernels.pdl
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_ptrs = x_ptr + row * x_row_stride + cols
    res_ptrs = res_ptr + row * res_row_stride + cols
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    summed = (x + residual).to(x_ptr.dtype.element_ty)
    tl.store(res_ptrs, summed, mask=mask)
    out = _scaled_norm(summed.to(tl.float32), w_ptr, cols, mask, hidden, eps, x_ptr.dtype.element_ty)
    tl.store(x_ptrs, out, mask=mask)
