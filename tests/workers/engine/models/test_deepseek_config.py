"""DeepSeek-V2/V3 configs read into the engine's ModelConfig as transformers reads them."""

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from tests.workers.engine.models.deepseek_configs import V2_LITE, V3
from workers.engine.config import MlaConfig, MoeConfig, RopeConfig
from workers.engine.models.deepseek import DeepseekV2, DeepseekV3
from workers.engine.models.registry import family_of, model_config
from workers.protocol.errors import ModelLoadError

# A small attention with the rope settings under test, to read HF's softmax scale from.
TINY_ATTENTION = dict(
    hidden_size=64,
    num_attention_heads=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=163840,
    num_hidden_layers=2,
    intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_group=2,
    topk_group=1,
)


def test_v2_lite_reads_as_mla_with_greedy_softmax_routing():
    config = model_config(V2_LITE)

    assert config.family == "deepseek_v2"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (16, 16, 192)
    assert config.layer_windows == (None,) * 27
    assert config.dtype == torch.bfloat16
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    assert config.mla == MlaConfig(
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        softmax_scale=pytest.approx(192**-0.5 * mscale**2, rel=1e-12),
        rope_interleave=True,
    )
    assert config.moe == MoeConfig(
        num_experts=64,
        top_k=6,
        intermediate_size=1408,
        routing="grouped_softmax",
        norm_topk_prob=False,
        sparse_layers=(False,) + (True,) * 26,
        num_groups=1,
        topk_groups=1,
        routed_scaling_factor=1.0,
        shared_intermediate_size=2 * 1408,
    )
    assert config.rope == RopeConfig(
        theta=10000.0,
        kind="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        attention_factor=1.0,  # mscale / mscale_all_dim
    )


def test_v3_reads_as_mla_with_grouped_sigmoid_routing():
    config = model_config(V3)

    assert config.family == "deepseek_v3"
    assert config.mtp_layers == 1
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (128, 128, 192)
    assert config.mla.q_lora_rank == 1536
    assert config.mla.rope_interleave is True
    assert config.mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2, rel=1e-12)
    assert config.moe == MoeConfig(
        num_experts=256,
        top_k=8,
        intermediate_size=2048,
        routing="grouped_sigmoid",
        norm_topk_prob=True,
        sparse_layers=(False, False, False, True),
        # The MTP layer (num_nextn_predict_layers), routed as a fifth layer would be.
        mtp_sparse_layers=(True,),
        num_groups=8,
        topk_groups=4,
        routed_scaling_factor=2.5,
        shared_intermediate_size=2048,
    )


def test_v3_rope_halves_when_its_config_says_so():
    assert model_config({**V3, "rope_interleave": False}).mla.rope_interleave is False


def test_v2_group_limited_greedy_reads_its_groups():
    config = model_config({**V2_LITE, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3})

    assert (config.moe.routing, config.moe.num_groups, config.moe.topk_groups) == ("grouped_softmax", 8, 3)


def test_num_key_value_heads_and_head_dim_of_the_config_are_not_the_heads():
    # HF writes head_dim = qk_rope_head_dim into saved configs; MLA has no KV heads of its own.
    config = model_config({**V2_LITE, "num_key_value_heads": 1, "head_dim": 64})

    assert (config.num_kv_heads, config.head_dim) == (16, 192)


@pytest.mark.parametrize("family, hf_config", [(DeepseekV2(), DeepseekV2Config), (DeepseekV3(), DeepseekV3Config)])
def test_defaults_for_missing_keys_are_transformers(family, hf_config):
    defaults = hf_config()

    for key, value in family.hf_defaults.items():
        assert getattr(defaults, key) == value, key


def test_a_sparse_v3_config_reads_transformers_defaults():
    config = model_config({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4})

    assert (config.hidden_size, config.num_heads, config.mla.q_lora_rank) == (7168, 128, 1536)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.num_groups, config.moe.topk_groups) == (256, 8, 8, 4)
    assert config.moe.sparse_layers == (False, False, False, True)
    assert config.rope.kind == "default" and config.max_position_embeddings == 4096


@pytest.mark.parametrize(
    "hf_config, attention, rope_scaling",
    [
        (DeepseekV2Config, DeepseekV2Attention, V2_LITE["rope_scaling"]),
        (DeepseekV3Config, DeepseekV3Attention, V3["rope_scaling"]),
        (DeepseekV3Config, DeepseekV3Attention, {**V3["rope_scaling"], "mscale_all_dim": 0}),
        (DeepseekV3Config, DeepseekV3Attention, None),
    ],
)
def test_softmax_scale_is_hf_attentions(hf_config, attention, rope_scaling):
    architecture = hf_config.model_type.replace("deepseek_v", "DeepseekV") + "ForCausalLM"
    raw = {**TINY_ATTENTION, "architectures": [architecture], "rope_scaling": rope_scaling}
    hf_scaling = attention(hf_config(**raw), layer_idx=0).scaling

    assert model_config(raw).mla.softmax_scale == hf_scaling


def test_architectures_name_their_family():
    assert isinstance(family_of(V2_LITE), DeepseekV2)
    assert isinstance(family_of(V3), DeepseekV3)


@pytest.mark.parametrize(
    "base, override, field",
    [
        (V2_LITE, {"attention_bias": True}, "attention_bias"),
        (V2_LITE, {"mlp_bias": True}, "mlp_bias"),
        (V2_LITE, {"hidden_act": "gelu"}, "hidden_act"),
        (V2_LITE, {"topk_method": "noaux_tc"}, "topk_method"),
        (V3, {"topk_method": "greedy"}, "topk_method"),
        (V2_LITE, {"scoring_func": "sigmoid"}, "scoring_func"),
        (V3, {"scoring_func": "softmax"}, "scoring_func"),
        (V2_LITE, {"moe_layer_freq": 2}, "moe_layer_freq"),
        (V2_LITE, {"norm_topk_prob": True}, "norm_topk_prob"),
        (V2_LITE, {"sliding_window": 4096}, "sliding_window"),
        (V2_LITE, {"topk_method": "group_limited_greedy", "n_group": None}, "n_group"),
        (V2_LITE, {"num_experts_per_tok": None}, "num_experts_per_tok"),
        (V3, {"n_group": 7}, "n_group"),
        (V3, {"rope_scaling": {**V3["rope_scaling"], "type": "dynamic"}}, "rope scaling"),
        (V3, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unserved_options_are_refused_by_name(base, override, field):
    with pytest.raises(ModelLoadError, match=field):
        model_config({**base, **override})
