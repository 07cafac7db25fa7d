"""Tiny Hugging Face mixture-of-experts models as references, one config per family we serve."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.workers.engine.hf_reference import TINY

TINY_MOE_CONFIGS = {
    # Layer 1 dense (mlp_only_layers), the others routed; renormalised top-2 of 8.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        **TINY,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Four layers, the odd ones routed (decoder_sparse_step=2); top-3 of 8 not renormalised; a
    # sigmoid-gated shared expert; q/k/v biases.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        **{**TINY, "num_hidden_layers": 4},
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    # DeepSeek-V3 routing: layer 0 dense (first_k_dense_replace), 16 experts in 4 groups, a token's
    # top-3 within its best 2 groups, renormalised and scaled by 2.5; two shared experts.
    "dots1": dict(
        model_type="dots1",
        architectures=["Dots1ForCausalLM"],
        **TINY,
        n_routed_experts=16,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    ),
    # DeepSeek-V2 (V2-Lite's kind): multi-head latent attention without query compression, YaRN with
    # mscale_all_dim (a softmax scale and rotary tables of its own), layer 0 dense, softmax routing
    # limited to the best 2 of 4 groups, two shared experts.
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        **{**TINY, "num_key_value_heads": 4},
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=1.0,
        ),
    ),
    # DeepSeek-V3: compressed queries (q LoRA), sigmoid routing within groups with a correction bias
    # (noaux_tc), the first two layers dense, one shared expert, interleaved rope.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        **{**TINY, "num_hidden_layers": 4, "num_key_value_heads": 4},
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=16,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        n_shared_experts=1,
        first_k_dense_replace=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}


def build_hf_moe_model(name: str, seed: int = 0) -> torch.nn.Module:
    return build_hf_moe_model_from(TINY_MOE_CONFIGS[name], seed)


def build_hf_moe_model_from(config_fields: dict, seed: int = 0) -> torch.nn.Module:
    """A random-weight HF MoE model of a config dict that names its model_type, its routers decisive."""
    raw = dict(config_fields)
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            elif param_name.endswith("mlp.gate.weight"):
                # Decisive routing: with HF's 0.02 init every token's expert scores nearly tie, and
                # float32 rounding differences between two correct implementations would pick
                # different experts.
                param.normal_(0.0, 1.0)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.2)
    return model.eval()
