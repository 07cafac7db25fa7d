"""Store blocks of an FP8-KV worker and of a worker keeping the model's dtype never serve each other:
their keys differ (block_hash.kv_model_id), and a block read under the other's layout is refused, not
converted, so the reader computes that KV instead of misreading its bytes."""

import random
from pathlib import Path

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, SamplingParams
from workers.kvstore.block_hash import kv_model_id, namespace_extra
from workers.kvstore.store import open_store

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [random.Random(7).randrange(3, 120) for _ in range(100)]


def llm(kv_cache_dtype: str, store: Path) -> LLM:
    return LLM(
        TINY_CONFIGS["llama"],
        seed=0,
        kv_cache_bytes=1 << 22,
        kv_cache_dtype=kv_cache_dtype,
        kv_store=store,
        kv_block_tokens=32,
    )


def test_the_kv_storage_enters_every_block_s_extra_and_auto_keeps_its_old_id():
    assert kv_model_id("m", "bfloat16") == kv_model_id("m", "bfloat16", "auto") == "m:bfloat16"
    assert namespace_extra(kv_model_id("m", "bfloat16", "fp8")) != namespace_extra(kv_model_id("m", "bfloat16"))


@pytest.mark.parametrize(("writer", "reader"), [("fp8", "auto"), ("auto", "fp8")])
def test_a_block_of_one_kv_dtype_is_refused_by_a_reader_of_the_other(writer, reader, tmp_path, caplog):
    written = llm(writer, tmp_path)
    written.generate([PROMPT], GREEDY)
    written.close()
    writer_layout = written.engine.kv_cache.specs.groups[0].layout
    store = open_store(tmp_path)
    stored = [(key, meta) for key, meta, _, _ in store.files.scan()]
    assert len(stored) == 3 and {meta.layout for _, meta in stored} == {writer_layout}

    other = llm(reader, tmp_path)
    reader_layout = other.engine.kv_cache.specs.groups[0].layout
    # The reader's keys are not the writer's: it never even asks for these blocks...
    result = other.generate([PROMPT], GREEDY)[0]
    assert result.num_cached_tokens == 0
    assert (
        result.token_ids
        == LLM(TINY_CONFIGS["llama"], seed=0, kv_cache_dtype=reader).generate([PROMPT], GREEDY)[0].token_ids
    )
    # ...and were it handed one, it would refuse it through its layout, naming both.
    key = stored[0][0]
    assert store.read([key], layout=reader_layout) == []
    assert f"holds {writer_layout}; the reader's KV is {reader_layout}: recomputing from there" in caplog.text
    assert len(store.read([key], layout=writer_layout)) == 1  # still there for readers of its layout
    other.close()
