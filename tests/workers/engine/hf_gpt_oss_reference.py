"""A tiny Hugging Face gpt-oss as the reference: alternating windowed and full layers, sinks, YaRN
rope, biased routing and clamped SwiGLU experts, with weights large enough that the clamps bite."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.workers.engine.hf_reference import TINY

TINY_GPT_OSS = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    **{**TINY, "num_hidden_layers": 4, "intermediate_size": 32},
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=1.5,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    ),
)


def build_hf_gpt_oss(seed: int = 0, **changes) -> torch.nn.Module:
    raw = {**TINY_GPT_OSS, **changes}
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = "eager"  # HF's gpt-oss has sinks in eager attention, not in SDPA
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)  # on the scale of the scores, so they matter
            elif name.endswith("router.weight"):
                param.normal_(0.0, 1.0)  # decisive routing: no near-ties for rounding to flip
            elif name.endswith("experts.gate_up_proj"):
                param.normal_(0.0, 0.3)  # gate and up reach past swiglu_limit on both sides
    return model.eval()
