"""A request continued on another engine: suspended between decode steps and handed over with its KV
(a migration), or resumed from its tokens with the KV store's blocks (a failover). Either way the
tokens are exactly those of an uninterrupted run, sampled ones included, because every sampled
request is given a seed at admission; a resume recomputes only what the store does not hold."""

import random

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, InvalidRequestError, SamplingParams
from workers.engine.engine import LLMEngine
from workers.protocol.engine_request import ContinueFromTokens, EngineRequest

BLOCK = 16
MAX_TOKENS = 40
PAGES = 1 << 22


def engine(store=None, block_tokens: int = BLOCK, device: str = "cpu") -> LLMEngine:
    options = {"seed": 0, "kv_cache_bytes": PAGES, "device": device}
    if device == "cuda":
        options["dtype"] = "float32"  # greedy tokens equal across a resume's recompute
    if store is not None:
        options |= {"kv_store": str(store), "kv_block_tokens": block_tokens}
    return LLM(TINY_CONFIGS["llama"], **options).engine


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "unseeded": SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
}


def run_until(engine: LLMEngine, count: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < count:
        for delta in engine.step():
            tokens.extend(delta.token_ids)
    return tokens


def finish(engine: LLMEngine) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.extend(delta.token_ids)
    return tokens


@pytest.mark.parametrize("kind", ["greedy", "unseeded"])
def test_a_request_migrated_between_decode_steps_continues_exactly(kind):
    reference = engine()
    reference.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(21, 1), params=PARAMS[kind]))
    expected = finish(reference)

    source, target = engine(), engine()
    source.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(21, 1), params=PARAMS[kind]))
    before = run_until(source, 9)
    suspended = source.suspend_for_migration("r")
    assert suspended is not None and suspended.finish_reason == "transfer" and suspended.token_ids == []
    hand_over(target, source.export_kv("r").materialized())
    assert source.release_transfer("r") and not source.has_unfinished()

    assert before + finish(target) == expected
    assert target.runner.num_computed_tokens == MAX_TOKENS - len(before)  # one new token a step, no recompute


@pytest.mark.parametrize("kind", ["greedy", "unseeded"])
def test_a_suspended_request_that_no_engine_takes_decodes_on_where_it_was(kind):
    reference = engine()
    reference.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(21, 1), params=PARAMS[kind]))
    expected = finish(reference)

    source = engine()
    source.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(21, 1), params=PARAMS[kind]))
    source.add_request(EngineRequest(request_id="other", prompt_token_ids=prompt(30, 3), params=PARAMS["greedy"]))
    tokens = {"r": [], "other": []}
    while len(tokens["r"]) < 9:
        for delta in source.step():
            tokens[delta.request_id].extend(delta.token_ids)
    assert source.suspend_for_migration("r") is not None
    export = source.export_kv("r")  # a transfer that then does not happen
    computed = source.runner.num_computed_tokens
    computed_tokens = len(tokens["r"]) + len(tokens["other"])

    assert source.resume_suspended("r")
    assert not source.resume_suspended("r") and not source.resume_suspended("unknown")
    with pytest.raises(RuntimeError, match="released"):
        export.layers[0]
    while source.has_unfinished():
        for delta in source.step():
            tokens[delta.request_id].extend(delta.token_ids)

    assert tokens["r"] == expected
    assert len(tokens["other"]) == MAX_TOKENS
    # one new token a step: nothing was recomputed, and every page came back
    assert source.runner.num_computed_tokens - computed == 2 * MAX_TOKENS - computed_tokens
    assert source.block_manager.num_free_pages == source.block_manager.num_usable_pages


@pytest.mark.parametrize("kind", ["greedy", "unseeded"])
def test_a_request_resumed_from_its_tokens_and_the_store_continues_exactly_recomputing_at_most_a_block(kind, tmp_path):
    lost = engine(tmp_path)
    lost.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(37, 2), params=PARAMS[kind]))
    params = lost.requests["r"].params  # with the seed it was given at admission: what its checkpoint carries
    assert params.seed is not None or kind == "greedy"
    expected = finish(lost)
    lost.close()  # its blocks are in the store now
    delivered = expected[:29]

    survivor = engine(tmp_path)
    survivor.add_request(
        EngineRequest(request_id="r2", prompt_token_ids=prompt(37, 2), params=params, kv=ContinueFromTokens(delivered))
    )
    rest = finish(survivor)

    assert delivered + rest == expected
    stats = survivor.resume_stats
    assert stats.num_resumed == 1
    assert 0 < stats.max_recomputed_tokens <= BLOCK


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])  # on CUDA the tail goes through a pinned staging buffer
@pytest.mark.parametrize("tail_stored", [True, False])
def test_a_resume_fetches_the_prompt_s_stored_tail_and_recomputes_only_what_was_generated_since(
    tail_stored, device, tmp_path
):
    # a prompt of 150 tokens in blocks of 64: two full blocks, then 22 tokens (one whole page) in the third
    block = 64
    lost = engine(tmp_path, block_tokens=block, device=device)
    lost.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(150, 4), params=PARAMS["greedy"]))
    expected = run_until(lost, 1)
    if tail_stored:
        lost.store_prompt_tail("r")  # what a decode worker that checkpoints does when it takes a request in
    expected += finish(lost)
    lost.close()  # 150 + 40 tokens never fill the third block: only the tail can be fetched of it
    delivered = expected[:29]

    survivor = engine(tmp_path, block_tokens=block, device=device)
    survivor.add_request(
        EngineRequest(
            request_id="r2", prompt_token_ids=prompt(150, 4), params=PARAMS["greedy"], kv=ContinueFromTokens(delivered)
        )
    )
    rest = finish(survivor)

    assert delivered + rest == expected
    fetched = 2 * block + (16 if tail_stored else 0)
    assert survivor.resume_stats.max_recomputed_tokens == 150 + len(delivered) - fetched


def resumed(request_id: str, output_token_ids: list[int], params: SamplingParams) -> EngineRequest:
    return EngineRequest(
        request_id=request_id, prompt_token_ids=[1, 2], params=params, kv=ContinueFromTokens(output_token_ids)
    )


def test_a_resume_is_refused_for_tokens_outside_the_vocabulary_a_finished_request_or_an_unseeded_sampler(tmp_path):
    survivor = engine(tmp_path)
    with pytest.raises(InvalidRequestError, match="output tokens"):
        survivor.add_request(resumed("a", [1, 10**6], PARAMS["greedy"]))
    with pytest.raises(InvalidRequestError, match="already has"):
        survivor.add_request(resumed("b", [3] * MAX_TOKENS, PARAMS["greedy"]))
    with pytest.raises(InvalidRequestError, match="without a seed"):
        survivor.add_request(resumed("c", [3], PARAMS["unseeded"]))
    assert not survivor.has_unfinished()


def test_a_resume_is_refused_by_an_engine_without_a_store():
    survivor = engine()
    with pytest.raises(InvalidRequestError, match="has none"):
        survivor.add_request(resumed("a", [3], PARAMS["greedy"]))
    assert not survivor.has_unfinished()


def test_only_a_request_between_decode_steps_can_be_suspended():
    source = engine()
    source.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(21, 1), params=PARAMS["greedy"]))
    assert source.suspend_for_migration("r") is None  # waiting: not yet prefilled
    assert source.suspend_for_migration("unknown") is None
    run_until(source, 1)
    assert source.suspend_for_migration("r") is not None
