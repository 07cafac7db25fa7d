"""The fused Triton ops a decoder layer uses on CUDA, imported on first use: the CPU path and
machines without Triton never load Triton."""

import functools
import importlib
from types import ModuleType

import torch


@functools.cache
def _fused() -> ModuleType:
    return importlib.import_module("kernels.fused")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fused().rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual)."""
    return _fused().fused_add_rms_norm(x, residual, weight, eps)


def rotary_and_cache_write(*args, **kwargs) -> torch.Tensor:
    return _fused().rotary_and_cache_write(*args, **kwargs)


def mla_rope_and_cache_write(*args, **kwargs) -> None:
    _fused().mla_rope_and_cache_write(*args, **kwargs)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _fused().silu_and_mul(gate_up)
