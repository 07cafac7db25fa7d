"""What a device's compiled Triton kernels may use: its CUDA compute capability, where kernels run
compiled on it (not on the CPU, not under the Triton interpreter, which runs no PTX)."""

import functools
import os

import torch


def compiled_capability(device: torch.device) -> tuple[int, int] | None:
    """`device`'s compute capability where Triton kernels run compiled on it, else None."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
