"""A hybrid model's prefix hit whose window pages were reused replays its windows (kv.window_replay):
exactly, it equals computing from scratch token for token; approximately, the next-token distribution
stays close to it; either way the full-attention pages of the hit are never written."""

import dataclasses
import importlib.util
import random

import pytest
import torch

from kernels.attention import AttentionMetadata, get_backend, layer_metadata
from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.swa_state import LocalSwaState, SwaStateCache
from workers.engine.kv.swa_stats import SwaStats
from workers.kvstore.block_hash import hash_chain, namespace_extra

HYBRID = ["qwen3_qknorm_layer_types", "qwen2_bias_sliding"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


def hybrid_llm(name: str, **options) -> LLM:
    """One request at a time, in chunks of 16 tokens: its window pool holds 8 usable pages, its full
    group 63, so another prompt's steps reuse a finished prompt's window pages long before its full
    pages."""
    settings = dict(seed=0, num_pages=64, page_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    return LLM(TINY_CONFIGS[name], **{**settings, **options})


def cached_full_pages(llm: LLM, tokens: list[int]) -> list[int | None]:
    """The full-attention pages the prefix cache holds for these tokens' whole pages (None: not held)."""
    extra = namespace_extra(llm.engine.kv_model_id, "")
    full = llm.engine.block_manager.pools[0]
    keys = hash_chain(tokens, 4, extra, max_blocks=len(tokens) // 4)
    return [full.cached(key, tuple(tokens[i * 4 : (i + 1) * 4])) for i, key in enumerate(keys)]


@pytest.mark.parametrize("name", HYBRID)
def test_an_exact_replay_equals_computing_from_scratch(name):
    first, other = prompt(50, seed=1), prompt(50, seed=2)
    llm = hybrid_llm(name, swa_replay="exact")
    llm.generate([first], GREEDY)
    llm.generate([other], GREEDY)  # reuses the window pages of `first`, not its full ones
    computed_before = llm.engine.stats().num_computed_tokens

    again = llm.generate([first], GREEDY)[0]
    stats = llm.engine.stats()

    reference = hybrid_llm(name, enable_prefix_caching=False).generate([first], GREEDY)[0]
    assert again.token_ids == reference.token_ids
    assert stats.swa.replays == 1
    # A hit one page short of the 48 cached tokens (44), replayed from 44 - 2 window layers × (6 - 1).
    replayed = stats.swa.replayed_tokens
    assert again.num_cached_tokens == 44 and replayed == (10 if name.startswith("qwen3") else 2 * 7)
    assert stats.num_computed_tokens - computed_before == 50 - 44 + replayed + GREEDY.max_tokens - 1


@pytest.mark.parametrize("name", HYBRID)
def test_an_approximate_replay_never_writes_the_hit_s_full_pages(name):
    first, other = prompt(50, seed=1), prompt(50, seed=2)
    llm = hybrid_llm(name)
    llm.generate([first], GREEDY)
    llm.generate([other], GREEDY)
    pages = cached_full_pages(llm, first)[:11]
    assert None not in pages
    full = llm.engine.kv_cache.group_pages[0]
    before = full[:, :, :, pages].clone()

    again = llm.generate([first], GREEDY)[0]

    stats = llm.engine.stats().swa
    assert stats.replays == 1 and again.num_cached_tokens == 44
    window = llm.engine.kv_cache.specs.groups[1].window
    assert stats.replayed_tokens == window
    # The replayed positions' full-attention KV, computed from cut windows, would differ: not written.
    assert torch.equal(full[:, :, :, pages], before)


def next_token_logprobs(model, specs, tokens, *, hit: int, replay_start: int | None) -> torch.Tensor:
    """log_softmax of the logits after `tokens`, computed from scratch (replay_start None) or, as the
    engine does after a hit of `hit` tokens whose window pages are lost, replaying from replay_start."""
    cache = KVCache(specs, num_pages=40, device=torch.device("cpu"))
    table = list(range(1, 1 + -(-len(tokens) // 4)))
    backend = get_backend("torch_blockwise")

    def forward(start: int, stop: int, first_keys: int, first_written: int) -> torch.Tensor:
        metadata = [
            AttentionMetadata.build(
                query_lens=[stop - start],
                seq_lens=[stop],
                block_tables=[table],
                page_size=4,
                device=torch.device("cpu"),
                first_keys=[first_keys] if group else None,
                first_written=[first_written] if not group else None,
            )
            for group in range(len(specs.groups))
        ]
        ids = torch.tensor(tokens[start:stop])
        hidden = model(
            ids, torch.arange(start, stop), cache.layers, layer_metadata(metadata, specs.group_of_layer), backend
        )
        return model.compute_logits(hidden[-1:])[0].log_softmax(-1)

    with torch.inference_mode():
        if replay_start is None:
            return forward(0, len(tokens), 0, 0)
        forward(0, hit, 0, 0)  # the cached prefix
        for pages in cache.group_pages[1:]:
            # Its window pages were reused by another request: what they hold now must never be read.
            pages.copy_(torch.randn(pages.shape, generator=torch.Generator().manual_seed(0)) * 100)
        return forward(replay_start, len(tokens), replay_start, hit)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


@pytest.mark.parametrize("name", HYBRID)
def test_an_approximate_replay_keeps_the_next_token_distribution_close(name):
    """The bound: on these tiny random models (next-token entropy near ln 128), the approximate replay's
    KL from computing from scratch stays under 0.005 nats and under a quarter of what skipping the
    replay costs (the windows then read nothing before the hit); the exact replay's is 0 to rounding."""
    llm = hybrid_llm(name)
    model, specs = llm.engine.runner.model, llm.engine.kv_cache.specs
    window = specs.groups[1].window
    span = 2 * (window - 1)  # the exact replay's: two window layers
    hit = 44
    divergences = []
    for seed in range(4):
        # The distribution after the hit's first token: the one the windows' replay affects most
        # (a query past the hit by more than the window layers' reach reads only exact KV).
        tokens = prompt(hit + 1, seed=seed)
        scratch = next_token_logprobs(model, specs, tokens, hit=hit, replay_start=None)
        exact = next_token_logprobs(model, specs, tokens, hit=hit, replay_start=hit - span)
        approximate = next_token_logprobs(model, specs, tokens, hit=hit, replay_start=hit - window)
        cut = next_token_logprobs(model, specs, tokens, hit=hit, replay_start=hit)
        divergences.append((kl(scratch, exact), kl(scratch, approximate), kl(scratch, cut)))

    assert all(
        exact < 1e-9 and approximate < 0.005 and approximate < cut / 4 for exact, approximate, cut in divergences
    )


@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_a_store_hit_of_a_hybrid_model_loads_the_full_group_and_replays_its_windows(mode, tmp_path):
    name = "qwen3_qknorm_layer_types"
    tokens = prompt(100, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 140 tokens: 4 whole blocks
    writer = hybrid_llm(name, kv_store=tmp_path, kv_block_tokens=32, swa_replay=mode)
    writer.generate([tokens[:90]], params)  # stores the prompt's first 2 blocks
    writer.close()

    # Another engine: the SWA state of the stored blocks is the writer's, not in this one's cache.
    reader = hybrid_llm(name, kv_store=tmp_path, kv_block_tokens=32, swa_replay=mode)
    result = reader.generate([tokens], params)[0]
    stats = reader.engine.stats()
    reader.close()

    reference = hybrid_llm(name, enable_prefix_caching=False).generate([tokens], params)[0]
    # Of the 2 whole blocks of 32 in the store, the hit backs off one for want of the SWA state at its
    # end; the windows' 6 (approximate) or 2 × 5 (exact) tokens before it replayed; the rest computed.
    assert result.num_cached_tokens == 32 and stats.store.num_hit_tokens == 32
    assert stats.swa.state_misses == 1 and stats.swa.state_hits == 0
    replayed = 10 if mode == "exact" else 6
    assert stats.swa.replayed_tokens == replayed
    assert stats.num_computed_tokens == 100 - 32 + replayed + params.max_tokens - 1
    if mode == "exact":
        assert result.token_ids == reference.token_ids
    # The full-attention layer's blocks only (the window layers' 2 × 32 tokens of 2 × 2 × 32 floats
    # each are not written), and none computed after an approximate replay.
    assert stats.swa.store_bytes_not_written == stats.store.num_blocks_written * 2 * 32 * (2 * 2 * 32 * 4)
    assert stats.store.num_blocks_written == (2 if mode == "exact" else 0)


def test_a_store_hit_whose_swa_state_the_engine_kept_takes_every_block_and_replays_nothing(tmp_path):
    name = "qwen3_qknorm_layer_types"
    tokens = prompt(100, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # No local prefix cache: the second prompt's prefix comes from the store, its SWA state from the
    # host cache the engine kept it in when it stored the blocks.
    llm = hybrid_llm(name, kv_store=tmp_path, kv_block_tokens=32, enable_prefix_caching=False)
    llm.generate([tokens[:90]], params)
    computed_before = llm.engine.stats().num_computed_tokens

    result = llm.generate([tokens], params)[0]
    stats = llm.engine.stats()
    llm.close()

    reference = hybrid_llm(name, enable_prefix_caching=False).generate([tokens], params)[0]
    assert result.num_cached_tokens == 64 and stats.store.num_hit_tokens == 64
    assert stats.swa.state_hits == 1 and stats.swa.state_misses == 0
    assert stats.swa.replays == 0 and stats.swa.replayed_tokens == 0
    assert stats.num_computed_tokens - computed_before == 100 - 64 + params.max_tokens - 1
    # The state is the windows' exact KV: the answer is the one computed from scratch.
    assert result.token_ids == reference.token_ids


def test_swa_state_of_another_layout_is_refused(tmp_path):
    llm = hybrid_llm("qwen3_qknorm_layer_types", kv_store=tmp_path, kv_block_tokens=32)
    window = llm.engine.info.swa_state_spec
    other = dataclasses.replace(window, window=window.window + 1)

    with pytest.raises(ValueError, match="does not fit this cache"):
        llm.engine.use_swa_state(LocalSwaState(SwaStateCache(other, 32, 1 << 20), SwaStats()))
    with pytest.raises(ValueError, match="16-token blocks; the store's have 32"):
        llm.engine.use_swa_state(LocalSwaState(SwaStateCache(window, 16, 1 << 20), SwaStats()))
    llm.close()


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="the device path on the CPU, under Triton's interpreter (the GPU runs it natively)",
)
@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_the_device_path_replays_as_the_reference_path_does(mode):
    first, other = prompt(50, seed=1), prompt(50, seed=2)
    outputs, replays = [], []
    for backend in ("torch_blockwise", "triton"):
        # Triton's pages hold 8 tokens at least: a window pool of 5 usable pages.
        llm = hybrid_llm("qwen3_qknorm_layer_types", swa_replay=mode, attention_backend=backend, page_size=8)
        llm.generate([first], GREEDY)
        llm.generate([other], GREEDY)
        outputs.append(llm.generate([first], GREEDY)[0].token_ids)
        replays.append(llm.engine.stats().swa)

    assert outputs[0] == outputs[1] and replays[0] == replays[1]
    assert replays[1].replayed_tokens == (10 if mode == "exact" else 6)
