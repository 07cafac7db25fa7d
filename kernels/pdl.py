"""Programmatic dependent launch (Hopper and later GPUs) for the chain of short kernels of a decode step.

At batch 1 a decode step is some 200 kernels of a few microseconds each, and the gap between one
kernel's end and the next one's first loads is a large share of each. A kernel launched with PDL
may start while the kernel before it in the stream is still running, once that kernel's programs
have called `gdc_launch_dependents` (or ended); it must call `gdc_wait`, which returns when the
kernel before has finished and its writes are visible, before it reads anything that kernel may
write or writes anything it may read.

The Triton kernels of a decode step's chain (the norms, the rotary embedding and cache write, decode
attention, SwiGLU's activation, the FP8 GEMV) are all launched so (`launch_options`) and all begin
with `pdl_prologue`: let the next kernel launch, then wait for the one before. So each kernel's
launch and start overlap the previous kernel's last programs. Waiting first keeps the chain's order:
a kernel finishes only after its own wait returned, so each one's predecessors have all finished.
After a kernel that never lets dependents launch early (cuBLAS, torch's own) the wait returns at once.
"""

import torch
import triton
import triton.language as tl

from kernels.device import compiled_capability

HOPPER = (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL: CUDA on Hopper or later, compiled (not interpreted)."""
    capability = compiled_capability(device)
    return capability is not None and capability >= HOPPER


def launch_options(device: torch.device) -> dict[str, bool]:
    """The PDL constexpr of a kernel that begins with `pdl_prologue`, and the launch flag with it."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """A PDL-launched kernel's first step: the next kernel may launch; wait for the one before."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
