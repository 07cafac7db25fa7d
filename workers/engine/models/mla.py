"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in its absorbed form.

Per token and layer the cache keeps one latent: the compressed KV (kv_lora_rank wide, after
kv_a_layernorm) followed by the rotary key (qk_rope_head_dim wide) that every head shares. HF
expands the latent into each head's key and value (kv_b_proj) and attends those; here kv_b_proj's
key half W_UK is folded into the query instead and its value half W_UV applied after attention:

    score = q_nope · (W_UK c) + q_rope · k_rope = (W_UKᵀ q_nope) · c + q_rope · k_rope
    out   = Σ p · (W_UV c) = W_UV (Σ p · c)

so attention is multi-query attention over the one latent head, with the query's absorbed part and
its rotary part as a kv_lora_rank + qk_rope_head_dim wide key, and the latent's first kv_lora_rank
values as the value. Every backend serves it through its usual call: the key cache is the latent
plane, the value cache its leading kv_lora_rank columns. Nothing per head is ever cached, and a
decode step reads kv_lora_rank + qk_rope_head_dim values per context token for all heads at once.

Rotary embeddings rotate adjacent pairs of the rope dims (DeepSeek's interleaved layout) or their
two halves, as the config says; either way the rotated rope part is kept in halves (HF V3's layout,
and the fused kernel's), and a query and a key rotate alike, so their product is HF's.
"""

from typing import Any

import torch
from torch import nn

from kernels.attention import AttentionBackend
from kernels.attention.paged import to_cache_rows
from workers.engine.config import ModelConfig
from workers.engine.layers.fused import mla_rope_and_cache_write
from workers.engine.layers.norm import RMSNorm
from workers.engine.layers.rotary import RotaryEmbedding, apply_rotary, deinterleave

# HF builds q_a_layernorm and kv_a_layernorm with the norm's default eps, not the config's.
LATENT_NORM_EPS = 1e-6

RotaryAngles = tuple[torch.Tensor, torch.Tensor]


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        self.num_heads = config.num_heads
        self.mla = mla
        qk_width = config.num_heads * mla.qk_head_dim
        # HF's module names, so checkpoints load by name.
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, qk_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, qk_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, mla.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, config.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(config.num_heads * mla.v_head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        angles: RotaryAngles | None,
        kv_cache: tuple[torch.Tensor, ...],
        metadata: Any,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """`angles`: the step's cos/sin for the reference path; None selects the fused kernel, which
        reads `rotary`'s tables by position itself."""
        mla = self.mla
        tokens = hidden.shape[0]
        (latent_cache,) = kv_cache
        query = self._query(hidden).view(tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = query.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed, k_rope = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_layernorm(compressed)
        if angles is None:
            # One kernel rotates the query's rope part in place and writes the latent with its rotated key.
            mla_rope_and_cache_write(
                q_rope,
                k_rope,
                compressed,
                positions,
                rotary.cos,
                rotary.sin,
                latent_cache,
                metadata.slot_mapping,
                interleave=mla.rope_interleave,
            )
        else:
            if mla.rope_interleave:
                q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
            q_rope = apply_rotary(q_rope, *angles)
            k_rope = apply_rotary(k_rope.unsqueeze(1), *angles).squeeze(1)
            write_latent(latent_cache, torch.cat([compressed, k_rope], dim=-1), metadata.slot_mapping)
        w_uk, w_uv = self._absorbed_weights()
        # [heads, tokens, nope] @ [heads, nope, kv_lora_rank]: each head's query against the latent.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        absorbed = torch.cat([q_latent, q_rope], dim=-1)
        out = backend(absorbed, latent_cache, latent_cache[..., : mla.kv_lora_rank], metadata, scale=mla.softmax_scale)
        # [heads, tokens, kv_lora_rank] @ [heads, kv_lora_rank, v_head_dim]: each head's value.
        values = torch.bmm(out.transpose(0, 1), w_uv).transpose(0, 1)
        return self.o_proj(values.reshape(tokens, self.num_heads * mla.v_head_dim))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK as [heads, nope, kv_lora_rank] and W_UVᵀ as [heads, kv_lora_rank, v_head_dim]: views
        of kv_b_proj's weight, so loading or replacing it needs nothing else."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return weight[:, : mla.qk_nope_head_dim], weight[:, mla.qk_nope_head_dim :].transpose(1, 2)


def write_latent(latent_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' latents ([tokens, latent_width]) at their slots of [1, pages, page_size,
    latent_width]."""
    n = slot_mapping.shape[0]
    latent_cache.view(-1, latent_cache.shape[-1]).index_copy_(0, slot_mapping, to_cache_rows(latents[:n], latent_cache))
