"""The torch dtypes of the engine's settings (workers.args.DTYPES names them, torch-free)."""

import torch

from workers.args import DTYPES


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of DTYPES."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return getattr(torch, name)


def dtype_name(dtype: str | torch.dtype) -> str:
    """The name in DTYPES of a torch dtype (or of a name, checked)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return name
