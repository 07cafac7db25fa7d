"""Fused Triton ops for a decoder layer, each a checked wrapper with a torch reference it is tested
against: RMSNorm (alone and after the residual add), rotary embedding with the paged KV-cache write
(and MLA's with its latent-cache write), and SwiGLU's silu-and-mul. Callers use the wrappers; the
references are plain torch."""

from kernels.fused.activation import silu_and_mul, silu_and_mul_reference
from kernels.fused.mla_rotary import mla_rope_and_cache_write, mla_rope_and_cache_write_reference
from kernels.fused.norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from kernels.fused.rotary import rotary_and_cache_write, rotary_and_cache_write_reference

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "mla_rope_and_cache_write",
    "mla_rope_and_cache_write_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_and_cache_write",
    "rotary_and_cache_write_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
]
