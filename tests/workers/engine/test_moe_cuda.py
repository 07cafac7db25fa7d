"""The MoE families on a CUDA device, through the fused Triton experts and the engine's CUDA
graphs (run on the accelerator machine: `pytest -m gpu`)."""

import pytest
import torch

from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS, build_hf_moe_model
from workers.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 100))]


@pytest.mark.parametrize("name", sorted(TINY_MOE_CONFIGS))
def test_float32_greedy_matches_hf_on_cuda(name, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_model = build_hf_moe_model(name)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, device="cuda", dtype="float32", kv_cache_bytes=1 << 26, max_num_batched_tokens=32)
    assert llm.engine.runner.graphs is not None
    ours = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    hf_model = hf_model.cuda()
    for prompt, result in zip(PROMPTS, ours, strict=True):
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


@pytest.mark.parametrize("name", sorted(TINY_MOE_CONFIGS))
def test_bfloat16_cuda_graphs_on_or_off_give_the_same_tokens(name):
    results = {}
    for eager in (False, True):
        # Two engines are alive at once as the loop goes round: each takes a share of the device.
        llm = LLM(
            TINY_MOE_CONFIGS[name],
            device="cuda",
            dtype="bfloat16",
            seed=0,
            enforce_eager=eager,
            gpu_memory_utilization=0.4,
        )
        assert (llm.engine.runner.graphs is None) == eager
        # 16 requests decode together: a bucket's size, so the graphs pad no rows and both runs
        # multiply the same shapes.
        prompts = [[(7 * i + j) % 128 for j in range(10 + 3 * i)] for i in range(16)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        results[eager] = [output.token_ids for output in outputs]
    assert results[False] == results[True]
