"""Our mixture-of-experts families against Hugging Face transformers on the same tiny random
weights, loaded from a saved checkpoint directory (per-expert tensors stacked on load)."""

import pytest
import torch

from kernels.attention import AttentionMetadata, get_backend
from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS, build_hf_moe_model
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.model_loader import load_model
from workers.engine.models.registry import model_config
from workers.engine.weights import load_weights, resolve_model
from workers.protocol.errors import ModelLoadError


@pytest.fixture(scope="module", params=sorted(TINY_MOE_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    model = build_hf_moe_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory


def test_prefill_logits_match_hf(hf_checkpoint):
    hf_model, directory = hf_checkpoint
    loaded = load_model(directory, device=torch.device("cpu"), dtype=torch.float32, seed=0, max_model_len=256)
    config, model = loaded.config, loaded.model
    assert config.moe is not None and any(config.moe.sparse_layers) and not all(config.moe.sparse_layers)
    tokens = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    kv = KVCache.for_model(config, num_pages=5, page_size=16, dtype=torch.float32, device=torch.device("cpu"))
    metadata = AttentionMetadata.build(
        query_lens=[45], seq_lens=[45], block_tables=[[3, 1, 4]], page_size=16, device=torch.device("cpu")
    )
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        hidden = model(
            tokens, torch.arange(45), kv.layers, [metadata] * config.num_layers, get_backend("torch_blockwise")
        )
        ours = model.compute_logits(hidden)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_hf_generate(hf_checkpoint):
    hf_model, directory = hf_checkpoint
    llm = LLM(directory, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16)  # chunked prefill too
    prompts = [[3, 14, 15, 92, 65], list(range(40, 70))]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            reference = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert result.token_ids == reference


def test_checkpoint_missing_an_expert_is_refused(hf_checkpoint):
    _, directory = hf_checkpoint
    loaded = load_model(directory, device=torch.device("cpu"), dtype=torch.float32, seed=0, max_model_len=256)
    names = [name for name, _ in loaded.model.named_parameters()]
    assert any(name.endswith("mlp.experts.w13") for name in names)
    assert not any(".experts.0." in name for name in names)  # stacked, not one module per expert
    layer = max(i for i, sparse in enumerate(loaded.config.moe.sparse_layers) if sparse)
    dropped = f"model.layers.{layer}.mlp.experts.3.up_proj.weight"
    tensors = [(name, tensor) for name, tensor in load_weights(resolve_model(directory)) if name != dropped]
    with pytest.raises(ModelLoadError, match=f"checkpoint lacks 1 tensors, e.g. \\['{dropped}'\\]"):
        loaded.model.load_weights(tensors)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, 8\]"),
        ("qwen3_moe", {"num_experts": 0}, "at least one expert"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1"),
        ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "unsupported hidden_act"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
        ("dots1", {"topk_group": 5}, r"topk_group must be in \[1, n_group=4\]"),
        ("dots1", {"n_group": 3}, r"n_group \(3\) must divide the 16 experts"),
        ("dots1", {"n_group": 16, "topk_group": 2}, "needs two experts or more"),
        ("dots1", {"topk_group": 1, "num_experts_per_tok": 5}, "exceeds the 4 experts"),
        ("dots1", {"routed_scaling_factor": 0.0}, "routed_scaling_factor must be positive"),
        ("dots1", {"first_k_dense_replace": 9}, "first_k_dense_replace"),
        ("dots1", {"attention_bias": True}, "attention_bias"),
        ("qwen2_moe", {"num_experts_per_tok": 0}, r"num_experts_per_tok must be in \[1, 8\]"),
        ("qwen2_moe", {"num_experts_per_tok": "three"}, "malformed field"),
        ("qwen2_moe", {"mlp_only_layers": 1}, "malformed field"),
    ],
)
def test_bad_moe_configs_are_refused(family, change, message):
    config = {**TINY_MOE_CONFIGS[family], **change}
    config = {key: value for key, value in config.items() if value is not None}
    with pytest.raises(ModelLoadError, match=message):
        model_config(config)


def test_sliding_windows_follow_each_family():
    qwen3 = {**TINY_MOE_CONFIGS["qwen3_moe"], "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}
    assert model_config(qwen3).layer_windows == (6, 6, 6)  # HF's Qwen3-MoE windows every layer
    dots1 = {key: value for key, value in TINY_MOE_CONFIGS["dots1"].items() if key != "layer_types"}
    dots1 = {**dots1, "sliding_window": 6, "max_window_layers": 2}
    assert model_config(dots1).layer_windows == (None, None, 6)
