"""Giving storage to a model built on the meta device, which is how an FP8 model loads
(workers.engine.model_loader): built there, its quantizable parts are converted to fp8 before any
tensor exists, so the float weights of those parts are never allocated.

`to_empty` leaves every tensor uninitialized. Weights are loaded or drawn afterwards; each buffer a
module computes at construction (rotary tables, Gemma's embedding scale, SigLIP's position ids, a
router's zero correction bias) its `init_buffers()` computes again, the method its __init__ calls.
The only other buffers are fp8 weights' scales (`*_scale_inv`), written as those weights load. A
module holding any other buffer is refused: it would be served uninitialized.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from workers.engine.weights.quantization import SCALE_SUFFIX


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Storage on `device` for every parameter and buffer of `model` (built on meta under default dtype
    `dtype`), its computed buffers computed as its construction computed them."""
    uncomputed = [
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules()
        if not hasattr(module, "init_buffers")
        for buffer, _ in module.named_buffers(recurse=False)
        if not buffer.endswith(SCALE_SUFFIX)
    ]
    if uncomputed:
        raise RuntimeError(
            f"buffers {uncomputed[:3]} would stay uninitialized once this model built on meta gets storage: "
            "their modules need an init_buffers() that computes them"
        )
    model.to_empty(device=device)
    with torch.device(device), default_dtype(dtype):
        for module in model.modules():
            if hasattr(module, "init_buffers"):
                module.init_buffers()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
