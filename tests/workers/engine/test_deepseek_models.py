"""DeepSeek-V2 and -V3 (multi-head latent attention over a latent paged cache) through the engine, on
tiny random weights: batching and bitwise batch invariance, prefix-cache hits, preemption, the global KV store, a
prefill → decode handoff, and the latent cache's size. Logits and greedy tokens against HF are in
test_moe_models, whose reference configs include both families."""

import random

import pytest
import torch

from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS, build_hf_moe_model
from tests.workers.engine.models.deepseek_configs import V2_LITE
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, SamplingParams
from workers.engine.kv.spec import KVCacheSpecs, KVKind
from workers.engine.model_loader import load_model
from workers.engine.models.registry import model_config
from workers.engine.weights import load_weights, resolve_model
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import ModelLoadError

FAMILIES = ["deepseek_v2", "deepseek_v3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


def llm(family: str, **options) -> LLM:
    return LLM(TINY_MOE_CONFIGS[family], **{"seed": 0, "kv_cache_bytes": 1 << 22, **options})


def tokens(engine: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def reference(family):
    """Each prompt alone, one-shot prefill, no cache of any kind: what every other run must equal."""
    engine = llm(family, enable_prefix_caching=False, max_num_batched_tokens=1024)
    return lambda prompts: [tokens(engine, [p])[0] for p in prompts]


def test_the_cache_is_one_latent_group_of_kv_lora_rank_plus_rope_values(family):
    engine = llm(family).engine
    specs = engine.runner.kv_cache.specs
    (group,) = specs.groups
    config = TINY_MOE_CONFIGS[family]
    assert group.kind is KVKind.LATENT
    assert group.bytes_per_token_per_layer == (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4


def test_v2_lite_keeps_1152_bytes_per_token_and_layer_in_bf16_against_4096_for_llama_8b():
    latent = KVCacheSpecs.of_model(model_config(V2_LITE), dtype=torch.bfloat16, page_size=16).groups[0]
    llama = {
        **V2_LITE,
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    }
    llama = {k: v for k, v in llama.items() if k != "rope_scaling"}
    full = KVCacheSpecs.of_model(model_config(llama), dtype=torch.bfloat16, page_size=16).groups[0]
    assert latent.bytes_per_token_per_layer == 1152
    assert full.bytes_per_token_per_layer == 4096


def test_a_batch_of_mixed_lengths_and_chunked_prefill_give_each_prompts_tokens_alone(family, reference):
    prompts = [prompt(3 + 13 * i % 71, seed=i) for i in range(12)]
    batched = llm(family, max_num_batched_tokens=23)
    assert tokens(batched, prompts) == reference(prompts)


def test_latent_attention_is_bitwise_batch_invariant_on_the_cpu(family):
    # Every layer dense: the routed experts' CPU loop multiplies as many rows as an expert got, so it
    # is not bitwise batch-invariant (in any MoE family); attention and the dense layers are.
    config = {**TINY_MOE_CONFIGS[family], "first_k_dense_replace": TINY_MOE_CONFIGS[family]["num_hidden_layers"]}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompts = [prompt(3 + 13 * i % 71, seed=i) for i in range(12)]
    alone = LLM(config, seed=0, kv_cache_bytes=1 << 22, enable_prefix_caching=False, max_num_batched_tokens=1024)
    expected = [alone.generate([p], params)[0] for p in prompts]
    batched = LLM(config, seed=0, kv_cache_bytes=1 << 22, max_num_batched_tokens=23).generate(prompts, params)
    for ours, theirs in zip(batched, expected, strict=True):
        assert [e.logprob for e in ours.logprobs] == [e.logprob for e in theirs.logprobs]


def test_prefix_hits_skip_the_shared_pages_and_change_no_token(family, reference):
    shared = prompt(70, seed=9)
    first, second = shared + [1, 2, 3], shared + [4, 5]
    engine = llm(family)
    engine.generate([first], GREEDY)
    result = engine.generate([second], GREEDY)[0]
    assert result.num_cached_tokens == 64
    assert result.token_ids == reference([second])[0]


def test_a_tiny_cache_preempts_and_every_request_completes_identically(family, reference):
    prompts = [prompt(n, seed=n) for n in (40, 35, 50, 28, 45, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 13 usable pages of 16 tokens: enough for any one request (<= 90 tokens = 6 pages), not for all.
    tight = LLM(TINY_MOE_CONFIGS[family], seed=0, num_pages=14)
    roomy = llm(family, enable_prefix_caching=False)
    assert tokens(tight, prompts, params) == tokens(roomy, prompts, params)
    assert tight.engine.stats().num_preemptions > 0


def test_stored_latent_blocks_serve_a_new_engine(family, reference, tmp_path):
    long = prompt(100, seed=3)
    first = llm(family, kv_store=tmp_path, kv_block_tokens=32)
    first.generate([long], GREEDY)
    first.close()
    fresh = llm(family, kv_store=tmp_path, kv_block_tokens=32)
    result = fresh.generate([long], GREEDY)[0]
    fresh.close()
    assert result.num_cached_tokens == 96
    assert fresh.engine.stats().store.num_hit_tokens == 96
    assert result.token_ids == reference([long])[0]


def test_prefill_on_one_engine_then_decode_on_another_equals_one_engine(family, reference):
    prompts = [prompt(45, seed=5), prompt(17, seed=6)]
    prefill, decode = llm(family, max_num_batched_tokens=19).engine, llm(family).engine
    out: dict[str, list[int]] = {}
    for index, p in enumerate(prompts):
        prefill.add_request(EngineRequest(request_id=str(index), prompt_token_ids=p, params=GREEDY, prefill_only=True))
        out[str(index)] = []
    while prefill.has_unfinished() or decode.has_unfinished():
        for delta in prefill.step():
            out[delta.request_id] += delta.token_ids
            if delta.finish_reason == "transfer":
                handoff = prefill.export_kv(delta.request_id).materialized()
                assert handoff.kv_layout == prefill.runner.kv_cache.specs.layout
                hand_over(decode, handoff)
                assert prefill.release_transfer(delta.request_id)
        for delta in decode.step():
            out[delta.request_id] += delta.token_ids
    assert [out[str(i)] for i in range(len(prompts))] == reference(prompts)


def test_a_latent_handoff_is_refused_by_an_engine_whose_cache_holds_keys_and_values():
    prefill = llm("deepseek_v2").engine
    gqa = LLM(TINY_MOE_CONFIGS["qwen3_moe"], seed=0, kv_cache_bytes=1 << 22).engine
    prefill.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(20), params=GREEDY, prefill_only=True))
    while prefill.has_unfinished():
        prefill.step()
    handoff = prefill.export_kv("r").materialized()
    with pytest.raises(Exception, match="latent"):
        hand_over(gqa, handoff)
    assert not gqa.has_unfinished()
    assert gqa.stats().num_free_pages == gqa.stats().num_pages


def test_v3_checkpoints_multi_token_prediction_layers_are_skipped_and_others_refused(tmp_path):
    model = build_hf_moe_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    config = TINY_MOE_CONFIGS["deepseek_v3"]
    extra = ("model.layers.4.self_attn.kv_b_proj.weight", torch.zeros(4))
    served = {**config, "num_nextn_predict_layers": 1}
    loaded = load_model(served, device=torch.device("cpu"), dtype=torch.float32, seed=0, max_model_len=64)
    loaded.model.load_weights([*load_weights(resolve_model(tmp_path)), extra])
    plain = load_model(config, device=torch.device("cpu"), dtype=torch.float32, seed=0, max_model_len=64)
    with pytest.raises(ModelLoadError, match="has no place in this model"):
        plain.model.load_weights([*load_weights(resolve_model(tmp_path)), extra])
