"""Speculation across engines: a request prefilled elsewhere speculates on its decode engine, and one
migrated in the middle of speculating continues exactly on another, with the tokens of a single
engine that never speculated."""

import random

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, SamplingParams
from workers.engine.engine import LLMEngine
from workers.protocol.engine_request import EngineRequest

MAX_TOKENS = 40


def quoting_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(7)] * 3


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    # Biased towards the prompt's tokens, so its sampled continuation quotes it too and drafts get made.
    "seeded": SamplingParams(
        temperature=0.8,
        top_p=0.9,
        seed=11,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        repetition_penalty=1.1,
        logit_bias={token: 5.0 for token in set(quoting_prompt(1))},
    ),
}


def engine(**settings) -> LLMEngine:
    return LLM(TINY_CONFIGS["llama"], seed=0, kv_cache_bytes=1 << 22, **settings).engine


def finish(engine: LLMEngine, tokens: list[int] | None = None) -> list[int]:
    tokens = [] if tokens is None else tokens
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.extend(delta.token_ids)
    return tokens


def expected_tokens(params: SamplingParams) -> list[int]:
    reference = engine()
    reference.add_request(EngineRequest(request_id="r", prompt_token_ids=quoting_prompt(1), params=params))
    return finish(reference)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_request_migrated_while_speculating_continues_exactly(kind):
    source, target = engine(spec_method="ngram"), engine(spec_method="ngram")
    source.add_request(EngineRequest(request_id="r", prompt_token_ids=quoting_prompt(1), params=PARAMS[kind]))
    before: list[int] = []
    while source.spec_stats.num_drafts < 2 and source.has_unfinished():
        for delta in source.step():
            before.extend(delta.token_ids)
    assert len(before) < MAX_TOKENS

    assert source.suspend_for_migration("r") is not None
    hand_over(target, source.export_kv("r").materialized())
    assert source.release_transfer("r")

    assert before + finish(target) == expected_tokens(PARAMS[kind])
    assert target.spec_stats.num_drafts > 0
    if kind == "greedy":
        assert source.spec_stats.num_accepted_tokens + target.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_request_prefilled_elsewhere_speculates_on_its_decode_engine(kind):
    prefill, decode = engine(), engine(spec_method="ngram")
    request = EngineRequest(request_id="r", prompt_token_ids=quoting_prompt(1), params=PARAMS[kind], prefill_only=True)
    prefill.add_request(request)
    first = finish(prefill)
    hand_over(decode, prefill.export_kv("r").materialized())
    assert prefill.release_transfer("r")

    assert first + finish(decode) == expected_tokens(PARAMS[kind])
    assert decode.spec_stats.num_drafts > 0
