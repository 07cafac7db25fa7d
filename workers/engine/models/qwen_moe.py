"""Qwen's mixture-of-experts families: top-k of softmax routing, in the layers decoder_sparse_step
and mlp_only_layers leave sparse. Qwen3-MoE has Qwen3's attention; Qwen2-MoE has Qwen2's and a
shared expert."""

from typing import Any

from workers.engine.config import MoeConfig
from workers.engine.models.family import DecoderFamily, routed_expert_settings
from workers.protocol.errors import ModelLoadError


class _QwenMoe(DecoderFamily):
    def moe_config(self, hf: dict[str, Any], num_layers: int) -> MoeConfig:
        top_k, intermediate, norm_topk_prob = routed_expert_settings(hf)
        shared = self.shared_expert_size(hf)
        dense_layers = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1))
        if step < 1:
            raise ModelLoadError(f"decoder_sparse_step must be at least 1, got {step}")
        if not dense_layers <= set(range(num_layers)):
            raise ModelLoadError(f"mlp_only_layers {sorted(dense_layers)} name layers outside 0..{num_layers - 1}")
        return MoeConfig(
            num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
            top_k=top_k,
            intermediate_size=intermediate,
            routing="softmax",
            norm_topk_prob=norm_topk_prob,
            sparse_layers=tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers)),
            shared_intermediate_size=shared,
            shared_expert_gate=shared > 0,
        )

    def shared_expert_size(self, hf: dict[str, Any]) -> int:
        return 0


class Qwen3Moe(_QwenMoe):
    name = "qwen3_moe"
    qk_norm = True

    def first_sliding_layer(self, hf: dict[str, Any]) -> int | None:
        # HF's Qwen3-MoE windows every layer, whatever max_window_layers says.
        return None if hf.get("use_sliding_window") is False else 0


class Qwen2Moe(_QwenMoe):
    name = "qwen2_moe"

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("qkv_bias", True))

    def shared_expert_size(self, hf: dict[str, Any]) -> int:
        # Its shared expert is always scaled by its sigmoid gate (shared_expert_gate).
        return int(hf.get("shared_expert_intermediate_size") or 0)
