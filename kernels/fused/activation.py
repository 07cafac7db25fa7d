"""SwiGLU's activation, silu(gate) * up, over a fused gate/up projection output, as a Triton kernel.

gate_up is [T, 2 * I], gate in the first I columns and up in the last I (the MLP's fused
gate_up_proj). The kernel computes gate / (1 + exp(-gate)) * up in float32 and rounds once to the
input dtype. The reference, `F.silu(gate) * up` in the input dtype as the model's MLP computes it,
rounds twice in bfloat16 / float16 (after the silu and after the product), so the two agree to
that dtype's rounding there and to float32 rounding for float32 inputs.

Grid: (T, cdiv(I, BLOCK)), one program per BLOCK columns of a row. Launch-only wrapper (no host
syncs, grid from shapes): safe to capture in a CUDA graph once a first call has compiled the kernel.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_prologue

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of each row of gate_up ([T, 2 * I]) into `out` (a new [T, I] tensor if None)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in FLOAT_DTYPES:
        raise ValueError(f"gate_up must be float32, float16 or bfloat16, got {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"gate_up's last dimension must be contiguous, got strides {gate_up.stride()}")
    tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (tokens, intermediate) or out.dtype != gate_up.dtype or out.device != gate_up.device:
        raise ValueError(
            f"out must be {(tokens, intermediate)} {gate_up.dtype} on {gate_up.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif out.stride(1) != 1:
        raise ValueError(f"out's last dimension must be contiguous, got strides {out.stride()}")
    grid = (tokens, triton.cdiv(intermediate, BLOCK))
    _silu_and_mul_kernel[grid](
        gate_up, gate_up.stride(0), out, out.stride(0), intermediate, BLOCK=BLOCK, **launch_options(gate_up.device)
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, gate_up_row_stride, out_ptr, out_row_stride, intermediate, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)  # kernels.pdl
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    src = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(src, mask=mask).to(tl.float32)
    up = tl.load(src + intermediate, mask=mask).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
