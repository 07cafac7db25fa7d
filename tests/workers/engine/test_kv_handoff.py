"""Prefill on one engine, decode on another: the KV handoff between two LLMEngine instances.

Tiny random-weight models on the CPU. Every disaggregated run must give exactly the tokens one
mixed engine gives for the same requests (batch-invariant kernels make that bitwise).
"""

import random
from collections.abc import Callable
from dataclasses import replace

import msgspec
import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, EngineOverloadedError, InvalidRequestError, SamplingParams
from workers.engine.connectors.handoff import continuing
from workers.engine.engine import LLMEngine
from workers.engine.kv_handoff import KVHandoff
from workers.protocol.engine_request import EngineRequest

SLIDING = "qwen3_qknorm_layer_types"  # windowed and full layers, q/k norm
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PAGES = 1 << 22  # kv_cache_bytes: plenty of pages for these tests
FULL_0_1 = "full attention of layers 0-1: 2 KV heads of 32 (float32)"
LATENT_0_2 = "latent of layers 0-2: a latent of 64 (float32)"


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


def engine(config: str = SLIDING, **options) -> LLMEngine:
    return LLM(TINY_CONFIGS[config], **{"seed": 0, "kv_cache_bytes": PAGES, **options}).engine


def mixed(config: str, prompts, params, **options) -> list[list[int]]:
    llm = LLM(TINY_CONFIGS[config], **{"seed": 0, "kv_cache_bytes": PAGES, **options})
    return [r.token_ids for r in llm.generate(prompts, params)]


def disaggregated(
    prefill: LLMEngine,
    decode: LLMEngine,
    prompts,
    params,
    through: Callable[[KVHandoff], KVHandoff] = KVHandoff.materialized,
) -> list[list[int]]:
    """Run prompts prefill-only on `prefill`, hand each to `decode` as it finishes (both engines
    stepping in turn), and return every request's tokens."""
    tokens: dict[str, list[int]] = {}
    for index, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(EngineRequest(request_id=str(index), prompt_token_ids=p, params=sp, prefill_only=True))
        tokens[str(index)] = []
    while prefill.has_unfinished() or decode.has_unfinished():
        for delta in prefill.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finish_reason == "transfer":
                hand_over(decode, through(prefill.export_kv(delta.request_id)))
                assert prefill.release_transfer(delta.request_id)
        for delta in decode.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def seeded(index: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.9, seed=7 + index, max_tokens=10, repetition_penalty=1.1, ignore_eos=True
    )


@pytest.mark.parametrize("config", [SLIDING, "llama"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefill_then_decode_elsewhere_equals_one_mixed_engine(config, prefix_caching):
    # Longer than the 19-token chunk; two share a 64-token prefix so the prefix cache hits.
    shared = prompt(64, seed=1)
    prompts = [prompt(150), shared + prompt(20, seed=2), prompt(40, seed=3), shared + prompt(9, seed=4)]
    params = [GREEDY, seeded(1), seeded(2), GREEDY]
    options = {"enable_prefix_caching": prefix_caching}
    expected = mixed(config, prompts, params, **options)

    prefill = engine(config, max_num_batched_tokens=19, **options)
    decode = engine(config, **options)
    assert disaggregated(prefill, decode, prompts, params) == expected

    for side in (prefill, decode):
        stats = side.stats()
        assert not side.has_unfinished() and stats.num_pending_transfers == 0
        assert stats.num_free_pages == stats.num_pages


def test_decode_outputs_report_the_prefill_sides_prompt_and_cache_counts():
    shared = prompt(40, seed=5)
    prefill, decode = engine(), engine()
    prefill.add_request(EngineRequest(request_id="warm", prompt_token_ids=shared + [1], params=GREEDY))
    while prefill.has_unfinished():
        prefill.step()
    prefill.add_request(
        EngineRequest(
            request_id="r",
            prompt_token_ids=shared + [2, 3],
            params=GREEDY,
            prefill_only=True,
            cache_namespace="",
            traffic_class="agent",
        )
    )
    (first,) = prefill.step()
    assert first.finish_reason == "transfer" and first.num_cached_tokens == 32
    handoff = prefill.export_kv("r")
    assert handoff.traffic_class == "agent" and handoff.num_computed_tokens == 42
    hand_over(decode, handoff.materialized())
    prefill.release_transfer("r")

    delta = decode.step()[0]
    assert (delta.num_prompt_tokens, delta.num_cached_tokens) == (42, 32)


def test_decode_reuses_the_prefix_pages_it_already_holds():
    shared = prompt(64, seed=6)
    prefill, decode = engine(), engine()
    decode.add_request(
        EngineRequest(
            request_id="earlier", prompt_token_ids=shared + [5], params=SamplingParams(temperature=0.0, max_tokens=1)
        )
    )
    while decode.has_unfinished():
        decode.step()
    cached_before = dict(decode.block_manager.cached_pages)
    assert len(cached_before) == 4  # the 64 shared tokens: 4 full pages of 16

    prefill.add_request(
        EngineRequest(request_id="r", prompt_token_ids=shared + [7, 8, 9], params=GREEDY, prefill_only=True)
    )
    prefill.step()
    hand_over(decode, prefill.export_kv("r").materialized())

    # 68 tokens (67 computed + the sampled one) span 5 pages: the 4 holding `shared` are the ones
    # "earlier" left in the prefix cache, attached rather than written again; one page is new.
    request = decode.requests["r"]
    assert request.pages[:4] == list(cached_before.values())
    assert request.pages[4] not in cached_before.values()
    assert decode.block_manager.cached_pages == cached_before
    assert decode.stats().num_free_pages == decode.stats().num_pages - 5
    while decode.has_unfinished():
        decode.step()
    assert decode.stats().num_free_pages == decode.stats().num_pages


def test_prefill_only_pages_stay_pinned_until_release_transfer():
    prefill = engine()
    total = prefill.stats().num_pages
    prefill.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(40), params=GREEDY, prefill_only=True))
    (delta,) = prefill.step()
    assert delta.finish_reason == "transfer" and delta.token_ids and delta.finished
    assert not prefill.has_unfinished()
    assert prefill.stats().num_free_pages == total - 3  # 40 prompt tokens in 3 pages of 16
    assert prefill.stats().num_pending_transfers == 1
    with pytest.raises(InvalidRequestError, match="already in use"):
        prefill.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(5), params=GREEDY))

    handoff = prefill.export_kv("r")
    layer = handoff.layers[0]
    assert tuple(layer.shape) == handoff.layer_shape == (2, 2, 40, 32)
    assert prefill.release_transfer("r")

    assert prefill.stats().num_free_pages == total
    assert not prefill.release_transfer("r")
    with pytest.raises(RuntimeError, match="released"):
        handoff.layers[1]
    with pytest.raises(InvalidRequestError, match="not awaiting"):
        prefill.export_kv("r")


def test_aborting_a_prefill_only_request_frees_its_pages_before_or_after_it_finishes():
    prefill = engine(max_num_batched_tokens=19)
    total = prefill.stats().num_pages
    prefill.add_request(
        EngineRequest(request_id="computing", prompt_token_ids=prompt(60), params=GREEDY, prefill_only=True)
    )
    prefill.step()  # one chunk of 19: still computing
    assert prefill.abort_request("computing").finish_reason == "abort"
    assert prefill.stats().num_free_pages == total

    prefill.add_request(
        EngineRequest(request_id="pinned", prompt_token_ids=prompt(10), params=GREEDY, prefill_only=True)
    )
    assert prefill.step()[0].finish_reason == "transfer"
    assert prefill.stats().num_free_pages == total - 1
    assert prefill.abort_request("pinned") is None
    assert prefill.stats().num_free_pages == total
    assert prefill.stats().num_pending_transfers == 0


def test_a_first_token_that_finishes_the_request_frees_it_instead_of_transferring():
    prefill = engine()
    prefill.add_request(
        EngineRequest(
            request_id="one",
            prompt_token_ids=prompt(20),
            params=SamplingParams(temperature=0.0, max_tokens=1),
            prefill_only=True,
        )
    )
    assert prefill.step()[0].finish_reason == "length"
    assert prefill.stats().num_free_pages == prefill.stats().num_pages
    with pytest.raises(InvalidRequestError, match="not awaiting"):
        prefill.export_kv("one")


def test_decode_frees_on_finish_and_on_abort():
    prefill, decode = engine(), engine()
    total = decode.stats().num_pages
    for rid in ("done", "aborted"):
        prefill.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=prompt(30, seed=len(rid)), params=GREEDY, prefill_only=True)
        )
    for delta in prefill.step():
        hand_over(decode, prefill.export_kv(delta.request_id).materialized())
        prefill.release_transfer(delta.request_id)
    decode.step()
    assert decode.abort_request("aborted").finish_reason == "abort"
    while decode.has_unfinished():
        decode.step()
    assert decode.stats().num_free_pages == total


def test_pending_transfers_are_capped():
    prefill = engine()
    prefill.max_pending_transfers = 2
    prefill.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt(10), params=GREEDY, prefill_only=True))
    prefill.step()  # "a" now awaits transfer
    prefill.add_request(
        EngineRequest(request_id="b", prompt_token_ids=prompt(10), params=GREEDY, prefill_only=True)
    )  # computing
    with pytest.raises(EngineOverloadedError, match="max_pending_transfers"):
        prefill.add_request(
            EngineRequest(request_id="c", prompt_token_ids=prompt(10), params=GREEDY, prefill_only=True)
        )
    prefill.add_request(
        EngineRequest(request_id="d", prompt_token_ids=prompt(10), params=GREEDY)
    )  # an ordinary request is not capped
    prefill.release_transfer("a")
    prefill.add_request(EngineRequest(request_id="c", prompt_token_ids=prompt(10), params=GREEDY, prefill_only=True))


def prefilled(length: int = 40, seed: int = 0) -> KVHandoff:
    prefill = engine()
    prefill.add_request(
        EngineRequest(request_id="r", prompt_token_ids=prompt(length, seed), params=GREEDY, prefill_only=True)
    )
    prefill.step()
    handoff = prefill.export_kv("r").materialized()
    prefill.release_transfer("r")
    return handoff


def test_over_capacity_raises_overloaded_and_leaks_nothing():
    handoff = prefilled(40)  # needs 3 pages
    small = engine(num_pages=5)  # 4 usable
    small.add_request(
        EngineRequest(
            request_id="busy", prompt_token_ids=prompt(20, seed=9), params=SamplingParams(temperature=0.0, max_tokens=4)
        )
    )
    small.step()  # "busy" holds 2 pages
    with pytest.raises(EngineOverloadedError, match="no room"):
        hand_over(small, handoff)
    assert small.stats().num_free_pages == 2
    assert "r" not in small.requests and small.stats().num_running == 1

    full = engine(max_num_seqs=1)
    full.add_request(EngineRequest(request_id="busy", prompt_token_ids=prompt(20, seed=9), params=GREEDY))
    full.step()
    with pytest.raises(EngineOverloadedError, match="max_num_seqs"):
        hand_over(full, handoff)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h: replace(h, kv_model_id="other:float32"), "holds KV of"),
        (lambda h: replace(h, layers=h.layers[:-1]), "2 layers of KV; it says 3"),
        (
            lambda h: replace(h, layers=h.layers[:-1], num_layers=2, kv_layout=FULL_0_1),
            r"holds KV laid out as 'full attention of layers 0-1: 2 KV heads of 32 \(float32\)'; this engine's cache "
            r"holds 'full attention of layers 1: 2 KV heads of 32 \(float32\); sliding window 6 of layers 0, 2",
        ),
        (
            lambda h: replace(h, kv_layout=LATENT_0_2, token_shape=(1, 1, 64)),
            r"holds KV laid out as 'latent of layers 0-2: a latent of 64 \(float32\)'; this engine's cache holds "
            r"'full attention of layers 1: 2 KV heads of 32 \(float32\); sliding window 6 of layers 0, 2",
        ),
        (lambda h: replace(h, layers=h.layers[:-1], num_layers=2), r"has 2 layers of torch.float32 \(2, 2, 32\)"),
        (lambda h: replace(h, token_shape=(2, 2, 16)), r"\(2, 2, 16\) per token, which is not its layout 'full"),
        (lambda h: replace(h, token_shape=(1, 4, 32)), r"\(1, 4, 32\) per token, which is not its layout 'full"),
        (lambda h: replace(h, kv_dtype=torch.bfloat16), r"torch.bfloat16 \(2, 2, 32\) per token, which is not"),
        (lambda h: replace(h, layers=[], num_layers=0), "has 0 layers of"),
        (lambda h: replace(h, layers=[t.to(torch.bfloat16) for t in h.layers]), "layer 0 is torch.bfloat16"),
        (lambda h: replace(h, layers=[t[:, :, :-1] for t in h.layers]), r"expected torch.float32 \(2, 2, 40, 32\)"),
        (lambda h: replace(h, num_computed_tokens=39), "KV for 39 tokens"),
        (lambda h: replace(h, output_token_ids=[]), "sampled tokens"),
        (lambda h: replace(h, output_token_ids=[500]), "sampled tokens"),
        (lambda h: replace(h, num_cached_tokens=41), "41 cached tokens"),
        (lambda h: replace(h, prompt_token_ids=[1] * 300, num_computed_tokens=300), "context window"),
        (lambda h: replace(h, params=replace_max_tokens(h.params, 1)), "nothing to decode"),
    ],
)
def test_a_handoff_that_does_not_fit_is_refused_clearly(change, message):
    decode = engine()
    with pytest.raises(InvalidRequestError, match=message):
        hand_over(decode, change(prefilled()))
    assert decode.stats().num_free_pages == decode.stats().num_pages and not decode.requests


def test_a_handed_over_request_without_its_kv_or_with_other_tokens_is_refused_clearly():
    decode = engine()
    handoff = prefilled()
    with pytest.raises(InvalidRequestError, match="no KV arrived for it here"):
        decode.add_request(continuing(handoff))
    decode.disaggregation.receive(handoff)
    with pytest.raises(InvalidRequestError, match="is of other tokens"):
        decode.add_request(msgspec.structs.replace(continuing(handoff), prompt_token_ids=[1, 2, 3]))
    with pytest.raises(InvalidRequestError, match="no KV arrived"):  # a refused request's KV is dropped
        decode.add_request(continuing(handoff))
    assert decode.stats().num_free_pages == decode.stats().num_pages and not decode.requests


def replace_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return msgspec.structs.replace(params, max_tokens=max_tokens)


def test_a_decode_engine_short_of_pages_refuses_preempts_and_still_matches():
    prompts = [prompt(n, seed=n) for n in (40, 35, 50, 28, 45, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), seeded(3)] * 3
    expected = mixed(SLIDING, prompts, params)
    prefill = engine()
    handoffs = {}
    tokens = {}
    for index, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(EngineRequest(request_id=str(index), prompt_token_ids=p, params=sp, prefill_only=True))
    for delta in prefill.step():
        tokens[delta.request_id] = list(delta.token_ids)
        handoffs[delta.request_id] = prefill.export_kv(delta.request_id).materialized()
        prefill.release_transfer(delta.request_id)

    # 13 usable pages: room for any one request (<= 90 tokens = 6 pages), not for all of them.
    decode = engine(num_pages=14)
    refused = 0
    while handoffs or decode.has_unfinished():
        for request_id in list(handoffs):
            try:
                hand_over(decode, handoffs[request_id])
            except EngineOverloadedError:
                refused += 1  # a router would try another decode engine; this test waits
            else:
                del handoffs[request_id]
        for delta in decode.step():
            tokens[delta.request_id].extend(delta.token_ids)

    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert refused > 0 and decode.stats().num_preemptions > 0
    assert decode.stats().num_free_pages == 13
