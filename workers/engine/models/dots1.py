"""dots.llm1: Qwen3's attention with DeepSeek-V3's mixture of experts (grouped sigmoid routing,
shared experts, the first layers dense), our model for DeepSeek-V3 routing until MLA attention is
served."""

from typing import Any

from workers.engine.config import MoeConfig
from workers.engine.models.family import DecoderFamily, routed_expert_settings
from workers.protocol.errors import ModelLoadError


class Dots1(DecoderFamily):
    name = "dots1"
    qk_norm = True

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        bias = super().attention_bias(hf)
        if bias:
            raise ModelLoadError("dots1 with attention_bias (which also biases o_proj) is not supported")
        return bias

    def first_sliding_layer(self, hf: dict[str, Any]) -> int | None:
        # dots.llm1 windows the layers from max_window_layers on (HF's default is 62).
        return int(hf.get("max_window_layers", 62))

    def moe_config(self, hf: dict[str, Any], num_layers: int) -> MoeConfig:
        top_k, intermediate, norm_topk_prob = routed_expert_settings(hf)
        first_sparse = int(hf.get("first_k_dense_replace") or 0)
        if not 0 <= first_sparse <= num_layers:
            raise ModelLoadError(f"first_k_dense_replace must be in [0, {num_layers}], got {first_sparse}")
        return MoeConfig(
            num_experts=int(hf.get("n_routed_experts") or 0),
            top_k=top_k,
            intermediate_size=intermediate,
            routing="grouped_sigmoid",
            norm_topk_prob=norm_topk_prob,
            sparse_layers=tuple(i >= first_sparse for i in range(num_layers)),
            num_groups=int(hf.get("n_group") or 1),
            topk_groups=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=intermediate * int(hf.get("n_shared_experts") or 0),
        )
