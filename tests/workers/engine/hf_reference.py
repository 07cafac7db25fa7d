"""Tiny Hugging Face models as references: configs covering each family feature we implement."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

TINY_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], **TINY),
    "llama_rope_llama3_tied": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        **{**TINY, "tie_word_embeddings": True},
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2_bias_sliding": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        **TINY,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    ),
    "qwen3_qknorm_layer_types": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        **TINY,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    return build_hf_model_from(TINY_CONFIGS[name], seed)


def build_hf_model_from(config_fields: dict, seed: int = 0) -> torch.nn.Module:
    """A random-weight HF model of a config dict that names its model_type."""
    raw = dict(config_fields)
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random, non-trivial norms and biases so that every parameter matters.
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if "norm" in name_ or name_.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()
