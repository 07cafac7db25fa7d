"""An EP engine of 2 gloo ranks serves DeepSeek-V2 and -V3 (multi-head latent attention, shared
experts, dense first layers) with the greedy tokens and logprobs of one process."""

import pytest

from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS
from workers.engine import LLM, SamplingParams

SETTINGS = dict(seed=0, kv_cache_bytes=1 << 22, max_num_batched_tokens=32, enable_prefix_caching=False)
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 80)), [100, 1, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_ep_engine_serves_deepseek_as_one_process_does(family):
    config = TINY_MOE_CONFIGS[family]
    one = LLM(config, **SETTINGS)
    expected = one.generate(PROMPTS, GREEDY)
    one.close()
    ep = LLM(config, **SETTINGS, ep_size=2, ep_slots_per_rank=config["n_routed_experts"] // 2 + 1)
    try:
        results = ep.generate(PROMPTS, GREEDY)
    finally:
        ep.close()
    for ours, theirs in zip(results, expected, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert [e.logprob for e in ours.logprobs] == pytest.approx([e.logprob for e in theirs.logprobs], abs=1e-4)
