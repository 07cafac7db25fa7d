"""Our model implementation against Hugging Face transformers on the same (tiny, random) weights."""

import pytest
import torch

from kernels.attention import TORCH_BACKENDS, AttentionMetadata, get_backend
from tests.workers.engine.hf_reference import TINY_CONFIGS, build_hf_model
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.models.decoder import DecoderForCausalLM
from workers.engine.models.registry import model_config


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def hf_model(request):
    return build_hf_model(request.param)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_prefill_logits_match_hf(hf_model, backend):
    config = model_config(hf_model.config.to_dict())
    model = DecoderForCausalLM(config, max_positions=256).eval()
    model.load_weights(hf_model.state_dict().items())
    tokens = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    kv = KVCache.for_model(config, num_pages=5, page_size=16, dtype=torch.float32, device=torch.device("cpu"))
    table = [3, 1, 4]  # pages out of order on purpose
    metadata = AttentionMetadata.build(
        query_lens=[45],
        seq_lens=[45],
        block_tables=[table],
        page_size=16,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        ours = model.compute_logits(
            model(tokens, torch.arange(45), kv.layers, [metadata] * config.num_layers, get_backend(backend))
        )
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_hf_generate(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16)  # chunked prefill too
    prompts = [[3, 14, 15, 92, 65], list(range(40, 80))]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            reference = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=30,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert result.token_ids == reference
