"""A hybrid model (full-attention and sliding-window layers) keeps its windows' KV in pools of their own:
the engine's output still equals Hugging Face's greedy generation with chunked prefill and prefix hits,
a window's pool is sized by its window, not by the context, and a handoff fills the window pages the
decode side reads."""

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS, build_hf_model
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, SamplingParams
from workers.engine.sizing.kv_sizing import window_group_pages
from workers.protocol.engine_request import EngineRequest

HYBRID = ["qwen3_qknorm_layer_types", "qwen2_bias_sliding"]
PROMPT = list(range(40, 90))
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return output[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", HYBRID)
def test_prefix_hits_and_chunked_prefill_equal_hf(name, tmp_path):
    hf_model = build_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, seed=0, kv_cache_bytes=1 << 22, max_num_batched_tokens=16, page_size=4)
    assert len(llm.engine.kv_cache.specs.groups) == 2

    first = llm.generate([PROMPT], GREEDY)[0]
    longer = PROMPT + first.token_ids + [7, 8, 9]
    again = llm.generate([PROMPT, longer], GREEDY)

    assert first.token_ids == hf_greedy(hf_model, PROMPT, GREEDY.max_tokens)
    assert again[0].token_ids == first.token_ids
    assert again[1].token_ids == hf_greedy(hf_model, longer, GREEDY.max_tokens)
    # Hits, each as long as the window pages before it were still cached.
    assert again[0].num_cached_tokens > 0 and again[1].num_cached_tokens > len(PROMPT) // 2


def test_a_window_pool_holds_its_window_for_each_running_request_and_a_step_s_chunks():
    llm = LLM(TINY_CONFIGS["qwen3_qknorm_layer_types"], seed=0, kv_cache_bytes=1 << 24, page_size=4)
    args = llm.engine.config.args
    cache = llm.engine.kv_cache
    full, window = cache.specs.groups

    expected = window_group_pages(
        window.window, page_size=4, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    # Per request, a window of 6 spans ceil(6 / 4) + 1 pages; a step's 2048 tokens take 512 pages, and
    # one more per request whose chunk straddles a page boundary.
    assert cache.group_num_pages[1] == expected == 1 + 64 * 3 + 512 + 64
    assert cache.group_num_pages[0] == ((1 << 24) - expected * window.page_bytes) // full.page_bytes
    assert llm.engine.block_manager.pools[1].num_pages == expected


def test_windows_that_would_outgrow_the_full_group_get_as_many_pages_as_it():
    llm = LLM(TINY_CONFIGS["qwen3_qknorm_layer_types"], seed=0, kv_cache_bytes=1 << 22, page_size=4)
    cache = llm.engine.kv_cache

    assert cache.group_num_pages == ((1 << 22) // cache.specs.page_bytes,) * 2


def test_a_handed_over_request_gets_window_pages_for_the_window_it_reads_only():
    config = TINY_CONFIGS["qwen3_qknorm_layer_types"]  # a window of 6; pages of 16
    prefill, decode = (LLM(config, seed=0, kv_cache_bytes=1 << 22).engine for _ in range(2))
    tokens = list(range(100))
    prefill.add_request(EngineRequest(request_id="r", prompt_token_ids=tokens, params=GREEDY, prefill_only=True))
    while not prefill.step():
        pass

    hand_over(decode, prefill.export_kv("r").materialized())

    request = decode.requests["r"]
    window = decode.block_manager.pages_of(request, 1)
    # 100 computed tokens; the first decode step's query (at 100) reads 95..100: pages 5 and 6.
    assert len(window) == len(request.pages) == 7
    assert window[:5] == [0] * 5 and 0 not in window[5:]
    while decode.has_unfinished():
        decode.step()
    mixed = LLM(config, seed=0, kv_cache_bytes=1 << 22).generate([tokens], GREEDY)[0]
    assert request.output_token_ids == mixed.token_ids
