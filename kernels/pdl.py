"""Programmatic dependent launch (Hopper and later GPUs) for the chain of short kernels of a decode step.

At batch 1 a decode step is some 200 kernels of a few microseconds each, and the gap between one
kernel's end and the next one's first loads is a large share of each. A kernel launched with PDL
may start while the kernel before it in the stream is still running, once that kernel's programs
have called `gdc_launch_dependents` (or ended); it must call `gdc_wait`, which returns when the
kernel before has finished and its writes are visible, before it reads anything that kernel may
write or writes anything it may read. The FP8 GEMV (kernels.quant.fp8_gemv) is launched so: its
weights are no kernel's output, so it fetches its first weight slab before it waits. The kernels
that precede it in a decode step (the norms, SwiGLU's activation, decode attention) let their
dependents launch as they start; for a next kernel launched without PDL that is a no-op.
"""

import functools
import os

import torch

HOPPER = 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL: CUDA on Hopper or later, compiled (not interpreted)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _compute_capability(device.index if device.index is not None else torch.cuda.current_device()) >= HOPPER


@functools.cache
def _compute_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
