"""The engine on a CUDA device (run on the accelerator machine: `pytest -m gpu`)."""

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS, build_hf_model
from workers.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_float32_greedy_matches_hf_on_cuda(name, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_model = build_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, device="cuda", dtype="float32", kv_cache_bytes=1 << 26, max_num_batched_tokens=32)
    prompts = [[3, 14, 15, 92, 65], list(range(40, 100))]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    hf_model = hf_model.cuda()
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            reference = hf_model.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert result.token_ids == reference


def test_bfloat16_batch_with_preemption_completes_on_cuda():
    llm = LLM(TINY_CONFIGS["llama"], device="cuda", seed=0, num_pages=14)
    prompts = [[i % 128 for i in range(start, start + 40)] for start in range(6)]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert all(len(r.token_ids) == 40 for r in results)
    assert llm.engine.stats().num_preemptions > 0
