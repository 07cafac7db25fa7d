"""An engine with --kv-cache-dtype fp8: its specs, sizing and cache, and what it generates (tiny
random-weight Llama, a hybrid sliding-window model and DeepSeek-V3's MLA) against the same engine
with the model's dtype, with chunked prefill, prefix-cache hits, store hits and handoffs."""

import random
from dataclasses import replace

import pytest
import torch

from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS
from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, InvalidRequestError, SamplingParams
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.kv_handoff import check_handoff
from workers.protocol.engine_request import EngineRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MODELS = {
    "llama": TINY_CONFIGS["llama"],
    "sliding window": TINY_CONFIGS["qwen3_qknorm_layer_types"],
    "deepseek_v3": TINY_MOE_CONFIGS["deepseek_v3"],
}
# Largest |logprob| difference of a prompt's tokens between fp8 and auto measured on these models:
# 0.0096 (llama), 0.014 (sliding window), 0.0068 (deepseek_v3); the bound leaves room for other seeds.
LOGPROB_BOUND = 0.05


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 120) for _ in range(length)]


def llm(model: str, kv_cache_dtype: str, **options) -> LLM:
    return LLM(MODELS[model], **{"seed": 0, "kv_cache_bytes": 1 << 22, "kv_cache_dtype": kv_cache_dtype, **options})


def tokens(engine: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [result.token_ids for result in engine.generate(prompts, GREEDY)]


def prompt_logprobs(engine: LLM, tokens_in: list[int]) -> torch.Tensor:
    engine.engine.add_request(
        EngineRequest(
            request_id="echo",
            prompt_token_ids=tokens_in,
            params=SamplingParams(temperature=0.0, max_tokens=1),
            prompt_logprobs=0,
        )
    )
    entries = None
    while engine.engine.has_unfinished():
        for delta in engine.engine.step():
            entries = delta.prompt_logprobs or entries
    return torch.tensor([entry.logprob for entry in entries[1:]])


@pytest.mark.parametrize(
    ("shape", "bf16", "fp8"),
    [
        (dict(kind=KVKind.FULL, num_kv_heads=8, head_dim=128), 4096, 2304),  # Llama-3.1-8B: 8 KV heads of 128
        (dict(kind=KVKind.LATENT, latent_width=576), 1152, 624),  # DeepSeek-V3: a latent of 576
    ],
)
def test_bytes_per_token_per_layer_follow_the_fp8_rows(shape, bf16, fp8):
    def spec(fp8: bool) -> KVCacheSpec:
        return KVCacheSpec(layers=(0,), dtype=torch.bfloat16, page_size=16, fp8=fp8, **shape)

    assert spec(False).bytes_per_token_per_layer == bf16
    assert spec(True).bytes_per_token_per_layer == fp8
    assert spec(True).storage_dtype == torch.uint8 and spec(True).dtype == torch.bfloat16
    assert spec(True).layout != spec(False).layout and "fp8" in spec(True).layout


def test_an_fp8_cache_is_uint8_pages_of_row_bytes_and_holds_the_tokens_its_bytes_allow():
    auto, fp8 = llm("llama", "auto", dtype="bfloat16"), llm("llama", "fp8", dtype="bfloat16")
    spec = fp8.engine.kv_cache.specs.groups[0]
    pages = fp8.engine.kv_cache.pages

    assert pages.dtype == torch.uint8
    # head_dim 16: 16 e4m3 bytes, one float32 scale, 12 zero bytes to a whole 16-byte vector
    assert pages.shape[-1] == 32 == spec.row_width
    assert fp8.engine.kv_cache.dtype == torch.bfloat16  # what attention computes in
    assert fp8.engine.kv_cache.num_pages == (1 << 22) // spec.page_bytes
    assert auto.engine.kv_cache.num_pages == (1 << 22) // auto.engine.kv_cache.specs.page_bytes
    # 32 bytes a head, as bf16's 16 values: a head this narrow gains no pages (128-wide ones hold 1.78x).
    assert fp8.engine.kv_cache.num_pages == pytest.approx(auto.engine.kv_cache.num_pages, abs=1)


def test_an_unknown_kv_cache_dtype_or_a_width_fp8_rows_cannot_hold_is_refused_naming_it():
    model_config = llm("llama", "auto", num_pages=4).engine.model_config
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int8'"):
        KVCacheSpecs.of_model(model_config, dtype=torch.float32, page_size=16, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' .* multiple of 4; this full attention KV group's is 30"):
        KVCacheSpec(
            kind=KVKind.FULL, layers=(0,), dtype=torch.bfloat16, page_size=16, num_kv_heads=1, head_dim=30, fp8=True
        )


@pytest.mark.parametrize("model", list(MODELS))
def test_fp8_generates_close_to_auto_with_chunked_prefill_and_a_prefix_hit(model):
    shared = prompt(40, seed=1)
    prompts = [prompt(50, seed=2), shared + prompt(10, seed=3), shared + prompt(7, seed=4)]
    auto = llm(model, "auto", max_num_batched_tokens=16)
    fp8 = llm(model, "fp8", max_num_batched_tokens=16)

    expected, results = tokens(auto, prompts), fp8.generate(prompts, GREEDY)
    got = [result.token_ids for result in results]

    assert [result.num_cached_tokens for result in results] == [0, 0, 32]  # the shared prefix's pages hit
    # Random tiny models have near-flat logits, so greedy paths part after a while; measured, 60 to
    # 72 of 72 tokens agree. Each prompt's first tokens agree.
    assert all(a[:3] == b[:3] for a, b in zip(expected, got, strict=True))
    diff = (prompt_logprobs(auto, prompts[0]) - prompt_logprobs(fp8, prompts[0])).abs().max().item()
    assert 0 < diff < LOGPROB_BOUND  # 0: the cache would not be FP8 at all


@pytest.mark.parametrize("model", list(MODELS))
def test_fp8_tokens_do_not_depend_on_chunking_or_on_prefix_hits(model):
    """A chunk's tokens attend to their own quantized KV (written before it is read), as later
    chunks and prefix hits read them: one-shot, chunked and cache-served prompts agree exactly."""
    shared = prompt(40, seed=1)
    prompts = [shared + prompt(10, seed=3), shared + prompt(7, seed=4)]
    one_shot = tokens(llm(model, "fp8", enable_prefix_caching=False), prompts)
    chunked = llm(model, "fp8", max_num_batched_tokens=16)
    assert tokens(chunked, prompts) == one_shot
    assert tokens(chunked, prompts) == one_shot  # now served from the prefix cache
    assert chunked.engine.stats().num_computed_tokens < 2 * sum(len(p) + 24 for p in prompts)


def test_stored_fp8_blocks_serve_a_new_fp8_engine(tmp_path):
    long = prompt(100, seed=3)
    first = llm("deepseek_v3", "fp8", kv_store=tmp_path, kv_block_tokens=32)
    expected = tokens(first, [long])
    first.close()
    fresh = llm("deepseek_v3", "fp8", kv_store=tmp_path, kv_block_tokens=32)
    result = fresh.generate([long], GREEDY)[0]
    fresh.close()
    assert result.num_cached_tokens == 96
    assert [result.token_ids] == expected


def handoff_from(kv_cache_dtype: str):
    prefill = llm("llama", kv_cache_dtype).engine
    prefill.add_request(
        EngineRequest(request_id="r", prompt_token_ids=prompt(40, seed=5), params=GREEDY, prefill_only=True)
    )
    while prefill.has_unfinished():
        prefill.step()
    return prefill.export_kv("r").materialized()


@pytest.mark.parametrize(("sender", "receiver"), [("fp8", "auto"), ("auto", "fp8")])
def test_a_handoff_between_kv_dtypes_is_refused_clearly(sender, receiver):
    handoff = handoff_from(sender)
    decode = llm("llama", receiver).engine

    with pytest.raises(InvalidRequestError, match="holds KV of"):
        hand_over(decode, handoff)
    # Past the model id (say, one spelled alike), the layout is what refuses the bytes.
    with pytest.raises(InvalidRequestError, match=r"holds KV laid out as .*; this engine's cache holds"):
        check_handoff(
            replace(handoff, kv_model_id=decode.kv_model_id),
            kv_model_id=decode.kv_model_id,
            vocab_size=decode.model_config.vocab_size,
            max_tokens=GREEDY.max_tokens,
            kv_cache=decode.kv_cache,
        )
    assert decode.stats().num_free_pages == decode.stats().num_pages and not decode.requests


def test_an_fp8_handoff_decodes_elsewhere_as_one_fp8_engine_would():
    handoff = handoff_from("fp8")
    assert handoff.kv_dtype == torch.uint8 and "fp8" in handoff.kv_layout
    decode = llm("llama", "fp8").engine
    hand_over(decode, handoff)
    out = []
    while decode.has_unfinished():
        out += [t for delta in decode.step() for t in delta.token_ids]
    assert handoff.output_token_ids + out == tokens(llm("llama", "fp8"), [handoff.prompt_token_ids])[0]
