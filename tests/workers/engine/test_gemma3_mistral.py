"""Gemma 3 (text) and Mistral, hybrid and all-layer sliding windows, against HF transformers on tiny
random models: prefill logits, greedy decoding through the engine, and the config fields refused."""

import pytest
import torch
from transformers import AutoConfig

from kernels.attention import TORCH_BACKENDS, AttentionMetadata, get_backend
from tests.workers.engine.hf_reference import TINY, build_hf_model_from
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.models.registry import family_of, model_config
from workers.protocol.errors import ModelLoadError

GEMMA3 = dict(
    model_type="gemma3_text",
    architectures=["Gemma3ForCausalLM"],
    **{**TINY, "num_hidden_layers": 4, "tie_word_embeddings": True},
    head_dim=32,
    query_pre_attn_scalar=20,
    sliding_window=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    final_logit_softcapping=0.5,
)
CONFIGS = {
    "gemma3_hybrid_softcapped": GEMMA3,
    # Layer types from the default pattern (every 6th layer global), exact GELU, untied, no softcap.
    "gemma3_untied_gelu": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        **{**TINY, "num_hidden_layers": 7},
        head_dim=16,
        sliding_window=5,
        hidden_activation="gelu",
    ),
    # HF's Mistral windows every layer and ignores layer_types.
    "mistral_sliding": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        **TINY,
        head_dim=32,
        sliding_window=7,
        layer_types=["full_attention"] * 3,
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_model(request):
    return build_hf_model_from(CONFIGS[request.param])


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_prefill_logits_match_hf(hf_model, backend):
    hf = hf_model.config.to_dict()
    config = model_config(hf)
    assert any(config.layer_windows)  # the windows are under test
    model = family_of(hf).model_class(config, max_positions=256).eval()
    model.load_weights(hf_model.state_dict().items())
    tokens = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    kv = KVCache.for_model(config, num_pages=5, page_size=16, dtype=torch.float32, device=torch.device("cpu"))
    metadata = AttentionMetadata.build(
        query_lens=[45], seq_lens=[45], block_tables=[[3, 1, 4]], page_size=16, device=torch.device("cpu")
    )
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        ours = model.compute_logits(
            model(tokens, torch.arange(45), kv.layers, [metadata] * config.num_layers, get_backend(backend))
        )
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_hf_generate_chunked_and_after_a_prefix_hit(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16)  # chunked prefill
    shared = list(range(40, 80))
    prompts = [[3, 14, 15, 92, 65], shared + [1, 2]]
    for prompt, result in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt)
    hit = llm.generate([shared + [7, 9, 11]], GREEDY)[0]
    assert hit.num_cached_tokens == 32  # two full pages of 16 shared tokens
    assert hit.token_ids == hf_greedy(hf_model, shared + [7, 9, 11])


def test_a_pre_transformers_5_gemma3_config_reads_as_transformers_reads_it():
    legacy = dict(
        architectures=["Gemma3ForCausalLM"],
        **{**TINY, "num_hidden_layers": 8},
        rope_theta=500000.0,
        rope_local_base_freq=2000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=4,
        sliding_window=16,
    )
    ours = model_config(legacy)
    theirs = model_config(AutoConfig.for_model("gemma3_text", **legacy).to_dict())
    assert ours == theirs
    assert ours.layer_windows == (16, 16, 16, None, 16, 16, 16, None)
    assert (ours.rope.theta, ours.rope.kind, ours.rope.factor) == (500000.0, "linear", 8.0)
    assert (ours.sliding_rope.theta, ours.sliding_rope.kind) == (2000.0, "default")
    assert ours.attention_scale == 256**-0.5 and ours.head_dim == 256


@pytest.mark.parametrize(
    ("base", "change", "named"),
    [
        (GEMMA3, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (GEMMA3, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (GEMMA3, {"hidden_activation": "relu"}, "hidden_activation"),
        (GEMMA3, {"attention_bias": True}, "attention_bias"),
        (GEMMA3, {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        (GEMMA3, {"final_logit_softcapping": "tight"}, "final_logit_softcapping"),
        (GEMMA3, {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, "rope_parameters"),
        (
            GEMMA3,
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "sliding_attention",
        ),
        (GEMMA3, {"layer_types": ["full_attention"] * 3}, "layer_types"),
        (GEMMA3, {"sliding_window": None}, "sliding_window"),
        (CONFIGS["mistral_sliding"], {"hidden_act": "gelu"}, "hidden_act"),
        (CONFIGS["mistral_sliding"], {"sliding_window": 0}, "sliding_window"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(base, change, named):
    with pytest.raises(ModelLoadError, match=named):
        model_config({**base, **change})


def test_a_mistral_config_without_sliding_window_gets_transformers_default_window():
    config = dict(CONFIGS["mistral_sliding"])
    del config["sliding_window"]
    assert model_config(config).layer_windows == (4096,) * 3
    assert model_config({**config, "sliding_window": None}).layer_windows == (None,) * 3


def test_gemma3_runs_the_reference_ops_when_asked_for_fused_ones(caplog: pytest.LogCaptureFixture):
    model = family_of(GEMMA3).model_class(model_config(GEMMA3), max_positions=64)

    model.use_fused_ops(True)

    assert model.fused_ops is False
    assert "Gemma 3 has no fused-ops path" in caplog.text


def test_gemma3_random_weights_start_its_offset_norms_at_identity():
    model = family_of(GEMMA3).model_class(model_config(GEMMA3), max_positions=64)

    model.init_random_weights(seed=0)

    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight")}
    assert len(norms) == 1 + 6 * GEMMA3["num_hidden_layers"]
    assert all(not p.any() for p in norms.values())
    assert model.layers[0].self_attn.qkv_proj.weight.std() > 0.01
