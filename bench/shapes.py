"""The model shapes the GPU benchmarks serve with random weights: Hugging Face config dicts by name.

One table, so every benchmark (engine throughput, KV handoff, store bytes) reads the same shapes
and a new one is one entry. Each is the published model's config with the fields that change no
shape left out; `layers` in a name says the shape keeps only that many of the model's layers (a
slice that fits one GPU beside its KV cache, with every layer's bytes as the full model's).
"""

from typing import Any

import torch

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.models.registry import model_config

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2_135m": SMOLLM2_135M_CONFIG,
    "llama3_8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # 16 of Qwen3-30B-A3B's 48 layers.
    "qwen3_30b_a3b_16_layers": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # All 27 layers: 64 routed experts (top-6) and 2 shared, the first layer dense; MLA without q LoRA.
    "deepseek_v2_lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # All 61 layers; in BF16 (the published checkpoint is FP8, which is not served yet).
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Hybrid attention: 128-token sliding windows alternating with full layers, attention sinks.
    "gpt_oss_20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Five 512-token local layers to one global, as the packaged gemma3-270m (make gemma) has.
    "gemma3_270m": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
}


# The FP8 benchmark's DeepSeek-V3: its first dense layer and 3 MoE layers of 256 experts.
SHAPES["deepseek_v3_4_layers"] = {**SHAPES["deepseek_v3"], "num_hidden_layers": 4, "first_k_dense_replace": 1}


def shape(name: str) -> dict[str, Any]:
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return {**SHAPES[name], "_name_or_path": name}


def kv_specs(
    name: str, *, dtype: torch.dtype = torch.bfloat16, page_size: int = 16, kv_cache_dtype: str = "auto"
) -> KVCacheSpecs:
    """The KV cache spec of a shape's model: what its device cache, store blocks and handoffs hold."""
    return KVCacheSpecs.of_model(
        model_config(shape(name)), dtype=dtype, page_size=page_size, kv_cache_dtype=kv_cache_dtype
    )
