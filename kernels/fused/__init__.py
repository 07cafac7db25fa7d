"""Fused Triton ops for a decoder layer, each a checked wrapper with a torch reference it is tested
against: RMSNorm (alone and after the residual add), rotary embedding with the paged KV-cache write,
SwiGLU's silu-and-mul, and, for decode-sized row counts, skinny GEMMs with the norm in their
prologue (a plain linear, gate_up with silu-and-mul, qkv with rotary and the cache write). Callers
use the wrappers; the references are plain torch."""

from kernels.fused.activation import silu_and_mul, silu_and_mul_reference
from kernels.fused.linear import (
    add_rms_norm_gate_up_silu,
    add_rms_norm_gate_up_silu_reference,
    add_rms_norm_linear,
    add_rms_norm_linear_reference,
)
from kernels.fused.norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from kernels.fused.qkv_rotary import add_rms_norm_qkv_rotary, add_rms_norm_qkv_rotary_reference
from kernels.fused.rotary import rotary_and_cache_write, rotary_and_cache_write_reference

__all__ = [
    "add_rms_norm_gate_up_silu",
    "add_rms_norm_gate_up_silu_reference",
    "add_rms_norm_linear",
    "add_rms_norm_linear_reference",
    "add_rms_norm_qkv_rotary",
    "add_rms_norm_qkv_rotary_reference",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_and_cache_write",
    "rotary_and_cache_write_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
]
