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
}


def build_hf_moe_model(name: str, seed: int = 0) -> torch.nn.Module:
    raw = dict(TINY_MOE_CONFIGS[name])
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
