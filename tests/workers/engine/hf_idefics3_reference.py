"""A tiny random-weight Hugging Face Idefics3 (SmolVLM's architecture) as a reference."""

import torch
from transformers import Idefics3Config, Idefics3ForConditionalGeneration

IMAGE_TOKEN_ID = 120
TINY_IDEFICS3 = dict(
    vision_config=dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        hidden_act="gelu_pytorch_tanh",
    ),
    text_config=dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    ),
    scale_factor=2,
    image_token_id=IMAGE_TOKEN_ID,
    tie_word_embeddings=False,
)


def build_hf_idefics3(seed: int = 0, **overrides) -> Idefics3ForConditionalGeneration:
    config = Idefics3Config(**{**TINY_IDEFICS3, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    # Random, non-trivial norms and biases so that every parameter matters.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()
