"""Speculation on the device path (Triton attention, persistent input batch, on-device sampling) on
the CPU, under Triton's interpreter: steps that verify drafts run eagerly and are sampled on the host,
the decode steps between them on the device, and the tokens are the reference path's without
speculation."""

import pytest
import torch
from msgspec.structs import replace

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.spec.test_speculative_engine import repeating_prompts
from workers.engine import LLM, SamplingParams

pytest.importorskip("triton")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="runs on the CPU under Triton's interpreter")

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, presence_penalty=0.3, frequency_penalty=0.2),
    SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=14, ignore_eos=True, repetition_penalty=1.1),
]


@CPU_ONLY
@pytest.mark.parametrize("name", ["llama", "qwen3_qknorm_layer_types"])
def test_device_path_with_speculation_gives_the_reference_tokens_without_it(name):
    prompts = repeating_prompts(4, seed=6)
    # Biased towards each prompt's tokens, so the sampled and penalised requests quote it too.
    params = [replace(p, logit_bias={t: 3.0 for t in set(q)}) for p, q in zip(PARAMS, prompts, strict=True)]
    reference = LLM(TINY_CONFIGS[name], seed=0, kv_cache_bytes=1 << 22)
    device = LLM(TINY_CONFIGS[name], seed=0, kv_cache_bytes=1 << 22, attention_backend="triton", spec_method="ngram")

    expected = reference.generate(prompts, params)
    results = device.generate(prompts, params)

    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [(e.token_id, e.rank) for e in results[1].logprobs] == [(e.token_id, e.rank) for e in expected[1].logprobs]
    assert device.engine.stats().spec_decode.num_accepted_tokens > 0
