"""The torch dtypes of the engine's settings (workers.args.DTYPES names them, torch-free)."""

import torch

from workers.args import DTYPES

# How an engine reports weights or KV held as e4m3 values with scales beside them (quantization and
# kv_cache_dtype "fp8"), where it reports torch's dtype names otherwise.
FP8_E4M3 = "fp8_e4m3"


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


# The dtypes KV data moves in (pages, store blocks, handoffs): the engine's, and uint8, the rows of an
# FP8 KV cache (kernels.attention.fp8_kv).
KV_STORAGE_DTYPES: dict[str, torch.dtype] = {**{name: torch_dtype(name) for name in DTYPES}, "uint8": torch.uint8}


def kv_storage_name(dtype: torch.dtype) -> str:
    """The name in KV_STORAGE_DTYPES of a KV tensor's dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in KV_STORAGE_DTYPES:
        raise ValueError(f"KV dtype {dtype} is not one of {sorted(KV_STORAGE_DTYPES)}")
    return name
