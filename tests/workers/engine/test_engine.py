"""Engine behaviour on tiny random-weight models: batching, chunking, prefix reuse, preemption."""

import random

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, InvalidRequestError, SamplingParams
from workers.protocol.engine_request import EngineRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CONFIG = TINY_CONFIGS["qwen3_qknorm_layer_types"]  # windowed and full layers, q/k norm


def prompts_of_lengths(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llm():
    return LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24)


def test_batch_of_32_mixed_lengths_gives_the_same_tokens_as_each_alone(llm):
    prompts = prompts_of_lengths([3 + 11 * i % 97 for i in range(32)])
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=256)
    together = [r.token_ids for r in batched.generate(prompts, GREEDY)]
    assert together == alone


def test_chunked_prefill_equals_one_shot_prefill():
    prompts = prompts_of_lengths([150, 77, 201])
    one_shot = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=1024)
    chunked = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=19)
    assert [r.token_ids for r in chunked.generate(prompts, GREEDY)] == [
        r.token_ids for r in one_shot.generate(prompts, GREEDY)
    ]


def test_prefix_reuse_gives_the_same_output_and_skips_the_work():
    shared = prompts_of_lengths([100])[0]
    first, second = shared + [1, 2, 3], shared + [4, 5]
    cold = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, enable_prefix_caching=False)
    expected = cold.generate([second], GREEDY)[0].token_ids

    warm = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24)
    warm.generate([first], GREEDY)
    before = warm.engine.stats().num_computed_tokens
    result = warm.generate([second], GREEDY)[0]
    computed = warm.engine.stats().num_computed_tokens - before

    assert result.token_ids == expected
    assert result.num_cached_tokens == 96  # 100 shared tokens = 6 full pages of 16
    # Only the uncached suffix and the decode steps ran through the model.
    assert computed == len(second) - 96 + GREEDY.max_tokens - 1


def test_tiny_kv_budget_preempts_and_still_completes_every_request_identically():
    prompts = prompts_of_lengths([40, 35, 50, 28, 45, 33])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24)
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    # 13 usable pages of 16 tokens: enough for any one request (<= 90 tokens = 6 pages), not for all.
    tight = LLM(CONFIG, seed=0, num_pages=14)
    results = tight.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert tight.engine.stats().num_preemptions > 0
    assert tight.engine.stats().num_free_pages == 13


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    prompt = prompts_of_lengths([20])[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    # Same seed inside a busy batch, at a different position.
    others = prompts_of_lengths([5, 60, 33], seed=9)
    batch = llm.generate(others + [prompt], [SamplingParams(temperature=1.0, max_tokens=24)] * 3 + [params])
    assert batch[3].token_ids == first
    other_seed = llm.generate(
        [prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99, ignore_eos=True)
    )
    assert other_seed[0].token_ids != first


def test_n_completions_are_independent_samples(llm):
    result = llm.generate([[1, 2, 3]], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=5))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) == 3


def test_stop_token_ids_max_tokens_and_logprobs(llm):
    prompt = [5, 6, 7]
    free_run = llm.generate([prompt], GREEDY)[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    stop_at = free_run.token_ids[4]
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop_at) + 1]
    assert stopped.outputs[0].stop_reason == stop_at
    with_logprobs = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0]
    assert len(with_logprobs.logprobs) == 4
    for token, lp in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert lp.token_id == token and lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == token


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "prompt is empty"),
        ([1, 2, 128], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        ([1] * 256, GREEDY, "context window"),
        ([1] * 250, SamplingParams(max_tokens=10), "exceeds the context window"),
        ([1, 2], SamplingParams(stop=("x",)), "need a tokenizer"),
        ("text", GREEDY, "need a tokenizer"),
    ],
)
def test_bad_input_raises_a_clear_error_and_the_engine_keeps_serving(llm, prompt, params, message):
    expected = llm.generate([[9, 8, 7]], GREEDY)[0].token_ids
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([[9, 8, 7], prompt], params)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[9, 8, 7]], GREEDY)[0].token_ids == expected


def test_request_too_large_for_the_kv_cache_is_refused():
    small = LLM(CONFIG, seed=0, num_pages=4)
    with pytest.raises(InvalidRequestError, match="KV pages"):
        small.generate([[1] * 40], SamplingParams(max_tokens=20))


def test_abort_frees_the_request_and_its_pages(llm):
    engine = llm.engine
    engine.add_request(
        EngineRequest(
            request_id="x", prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(temperature=0.0, max_tokens=50)
        )
    )
    engine.step()
    assert engine.stats().num_running == 1
    delta = engine.abort_request("x")
    assert delta.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.stats().num_free_pages == engine.stats().num_pages
    assert engine.abort_request("x") is None
