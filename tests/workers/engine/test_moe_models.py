"""Our mixture-of-experts families against Hugging Face transformers on the same tiny random
weights, loaded from a saved checkpoint directory (per-expert tensors stacked on load)."""

import pytest
import torch

from kernels.attention import AttentionMetadata, get_backend
from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS, build_hf_moe_model
from workers.engine import LLM, SamplingParams
from workers.engine.config import ModelConfig
from workers.engine.errors import ModelLoadError
from workers.engine.kv_cache import KVCache
from workers.engine.model_loader import load_model


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
    kv = KVCache(config, num_pages=5, page_size=16, dtype=torch.float32, device=torch.device("cpu"))
    metadata = AttentionMetadata.build(
        query_lens=[45], seq_lens=[45], block_tables=[[3, 1, 4]], page_size=16, device=torch.device("cpu")
    )
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        hidden = model(tokens, torch.arange(45), kv.layers, metadata, get_backend("torch_blockwise"))
        ours = model.compute_logits(hidden)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_hf_generate(hf_checkpoint):
    hf_model, directory = hf_checkpoint
    llm = LLM(directory, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16)  # chunked prefill too
    prompts = [[3, 14, 15, 92, 65], list(range(40, 80))]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            reference = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert result.token_ids == reference


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, 8\]"),
        ("qwen3_moe", {"num_experts": 0}, "at least one expert"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1"),
        ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "unsupported hidden_act"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_bad_moe_configs_are_refused(family, change, message):
    config = {**TINY_MOE_CONFIGS[family], **change}
    config = {key: value for key, value in config.items() if value is not None}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_config(config)
