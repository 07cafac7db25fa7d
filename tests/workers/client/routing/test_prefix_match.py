"""The entrypoint's prefix match: from token ids to the hit length the engine will really serve,
reading the index alone."""

import random
import shutil

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.client.routing.prefix_match import store_hit_tokens
from workers.engine import LLM, SamplingParams
from workers.kvstore.block_hash import namespace_extra
from workers.kvstore.store import open_store

CONFIG = TINY_CONFIGS["llama"]
BLOCK = 32


def test_the_hit_length_is_what_the_engine_then_serves_and_needs_no_block_data(tmp_path):
    prompt = [random.Random(0).randrange(128) for _ in range(200)]
    llm = LLM(CONFIG, seed=0, kv_store=tmp_path / "store", kv_block_tokens=BLOCK)
    llm.generate([prompt[:150]], SamplingParams(temperature=0.0, max_tokens=1), cache_namespace="tenant")
    llm.close()
    extra = namespace_extra(llm.engine.kv_model_id, "tenant")
    store = open_store(tmp_path / "store")

    predicted = store_hit_tokens(store.index, prompt, block_tokens=BLOCK, extra=extra)
    serving = LLM(CONFIG, seed=0, kv_store=tmp_path / "store", kv_block_tokens=BLOCK)
    served = serving.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), cache_namespace="tenant")[0]
    serving.close()

    assert predicted == served.num_cached_tokens == 128  # 150 computed tokens: 4 whole blocks
    shutil.rmtree(tmp_path / "store")  # the index alone answers
    assert store_hit_tokens(store.index, prompt, block_tokens=BLOCK, extra=extra) == 128


def test_other_namespaces_short_prompts_and_diverging_prompts(tmp_path):
    prompt = [random.Random(1).randrange(128) for _ in range(100)]
    llm = LLM(CONFIG, seed=0, kv_store=tmp_path, kv_block_tokens=BLOCK)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    llm.close()
    index = open_store(tmp_path).index
    extra = namespace_extra(llm.engine.kv_model_id, "")

    def hit(tokens, extra=extra):
        return store_hit_tokens(index, tokens, block_tokens=BLOCK, extra=extra)

    assert hit(prompt) == 96
    assert hit(prompt, namespace_extra(llm.engine.kv_model_id, "other tenant")) == 0
    assert hit(prompt[:33]) == 32  # one token is always left to compute
    assert hit(prompt[:32]) == 0
    assert hit([]) == 0
    diverged = prompt[:40] + [(prompt[40] + 1) % 128] + prompt[41:]
    assert hit(diverged) == 32
