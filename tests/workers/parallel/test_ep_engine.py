"""An EP engine of 2 and 4 gloo ranks (processes) serves a tiny random Qwen3-MoE with the greedy
tokens and logprobs of one process, with redundant experts too; a rank without requests does not
stall the others."""

import pytest

from workers.engine import LLM, SamplingParams
from workers.engine.parallel.ep_engine import EPEngine

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)
SETTINGS = dict(seed=0, kv_cache_bytes=1 << 22, max_num_batched_tokens=32)
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 80)), [7] * 9, [100, 1, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _tokens_and_logprobs(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    results = llm.generate(prompts, GREEDY)
    return [r.token_ids for r in results], [[entry.logprob for entry in r.logprobs] for r in results]


@pytest.fixture(scope="module")
def one_process():
    llm = LLM(QWEN3_MOE, **SETTINGS)
    yield _tokens_and_logprobs(llm, PROMPTS)
    llm.close()


@pytest.mark.parametrize(("ep_size", "slots_per_rank"), [(2, 5), (4, 3)])
def test_ep_engine_matches_one_process(one_process, ep_size, slots_per_rank):
    llm = LLM(QWEN3_MOE, **SETTINGS, ep_size=ep_size, ep_slots_per_rank=slots_per_rank)
    try:
        engine = llm.engine
        assert isinstance(engine, EPEngine) and engine.ep_size == ep_size
        # Redundant slots hold replicas: some expert has two.
        layer = [expert for rank in engine.placement[0] for expert in rank]
        assert len(layer) == ep_size * slots_per_rank and len(set(layer)) == 8
        tokens, logprobs = _tokens_and_logprobs(llm, PROMPTS)
        assert tokens == one_process[0]
        for ours, theirs in zip(logprobs, one_process[1], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-4)
        # One request: the other ranks have none and run empty passes; it completes all the same.
        tokens, _ = _tokens_and_logprobs(llm, PROMPTS[1:2])
        assert tokens == one_process[0][1:2]
    finally:
        llm.close()
