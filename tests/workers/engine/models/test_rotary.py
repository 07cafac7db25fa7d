"""Rotary tables against transformers' rope initialisation: YaRN as DeepSeek configures it, and the
kinds served before it; DeepSeek's interleaved pair rotation against HF's V2 and V3."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)

from tests.workers.engine.models.deepseek_configs import V2_LITE, V3
from workers.engine.layers.rotary import RotaryEmbedding, apply_rotary, deinterleave, inverse_frequencies
from workers.engine.models.registry import model_config

ROPE_WIDTH = 64

YARN_SCALINGS = {
    "v2_lite": V2_LITE["rope_scaling"],
    "v3": V3["rope_scaling"],
    # Only mscale: the attention factor is YaRN's own 0.1 * ln(factor) + 1.
    "mscale_only": {"type": "yarn", "factor": 40, "mscale": 1.0, "original_max_position_embeddings": 4096},
    "untruncated": {**V3["rope_scaling"], "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "attention_factor": {**V3["rope_scaling"], "attention_factor": 0.8},
    # No factor: the extended context over the original one (163840 / 4096).
    "implicit_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
}


def deepseek_v3(rope_scaling: dict) -> tuple[dict, DeepseekV3Config]:
    raw = {**V3, "rope_scaling": rope_scaling, "rope_theta": 10000.0}
    return raw, DeepseekV3Config(**{k: v for k, v in raw.items() if k != "architectures"})


@pytest.mark.parametrize("name", YARN_SCALINGS)
def test_yarn_frequencies_and_attention_factor_are_hfs(name):
    raw, hf_config = deepseek_v3(YARN_SCALINGS[name])
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)

    rope = model_config(raw).rope

    assert rope.kind == "yarn"
    torch.testing.assert_close(inverse_frequencies(rope, ROPE_WIDTH), hf_inv_freq, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(hf_attention_factor, abs=1e-6)


def test_yarn_differs_from_plain_rope_where_it_should():
    rope = model_config(V3).rope
    plain = inverse_frequencies(model_config({**V3, "rope_scaling": None}).rope, ROPE_WIDTH)
    yarn = inverse_frequencies(rope, ROPE_WIDTH)

    assert torch.equal(yarn[:4], plain[:4])  # fast pairs keep their frequency
    torch.testing.assert_close(yarn[-4:], plain[-4:] / 40)  # slow ones are interpolated


@pytest.mark.parametrize("name", ["mscale_only", "v3"])
def test_cos_and_sin_carry_the_attention_factor_as_hfs(name):
    raw, hf_config = deepseek_v3(YARN_SCALINGS[name])
    positions = torch.tensor([0, 1, 7, 4095, 4096, 100_000])
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions[None])

    cos, sin = RotaryEmbedding(model_config(raw).rope, ROPE_WIDTH, 100_001).angles(positions, torch.float32)

    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_kinds_served_before_yarn_are_unchanged(rope_scaling):
    raw = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
    )
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    kind = hf_config.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(kind)
    hf_inv_freq = init(hf_config)[0] if init else 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))

    rope = model_config(raw).rope

    assert rope.attention_factor == 1.0
    torch.testing.assert_close(inverse_frequencies(rope, 64), hf_inv_freq, rtol=1e-6, atol=0)


def rotary_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 3, 4096, 70_000])
    q = torch.randn(len(positions), 4, ROPE_WIDTH, generator=generator)  # [T, heads, rope width]
    k = torch.randn(len(positions), 1, ROPE_WIDTH, generator=generator)
    return positions, q, k


def test_v2_adjacent_pairs_rotate_as_hfs_in_halves_layout():
    positions, q, k = rotary_inputs(seed=4)
    raw = {**V2_LITE, "rope_theta": 10000.0}
    hf_config = DeepseekV2Config(**{key: v for key, v in raw.items() if key != "architectures"})
    freqs_cis = DeepseekV2RotaryEmbedding(hf_config)(q, positions[None])  # [1, T, width / 2]
    # HF's layout: [batch, heads, T, width]; V2 rotates each pair where it stands.
    hf_q, hf_k = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis)

    config = model_config(raw)
    cos, sin = RotaryEmbedding(config.rope, config.mla.qk_rope_head_dim, 70_001).angles(positions, torch.float32)

    assert config.mla.rope_interleave
    for ours, theirs in ((q, hf_q), (k, hf_k)):
        rotated = apply_rotary(deinterleave(ours), cos, sin)
        torch.testing.assert_close(rotated, deinterleave(theirs[0].transpose(0, 1)), rtol=1e-5, atol=1e-5)


def test_v3_interleave_is_hfs_exactly():
    positions, q, k = rotary_inputs(seed=5)
    raw, hf_config = deepseek_v3(V3["rope_scaling"])
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q, k, hf_cos[0], hf_sin[0])

    config = model_config(raw)
    cos, sin = RotaryEmbedding(config.rope, config.mla.qk_rope_head_dim, 70_001).angles(positions, torch.float32)

    assert config.mla.rope_interleave
    torch.testing.assert_close(apply_rotary(deinterleave(q), cos, sin), hf_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(deinterleave(k), cos, sin), hf_k, rtol=1e-5, atol=1e-5)
