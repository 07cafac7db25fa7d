"""A request that fails on its own (its constraint, its output's processing) ends alone: the others in
its batch finish with the tokens they give without it, and its pages come back."""

import random

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import add_constrained, hand_over
from workers.engine import LLM, RequestDelta, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.structured.constraint import ConstraintError
from workers.protocol.engine_request import EngineRequest

CONFIG = TINY_CONFIGS["qwen3_qknorm_layer_types"]
VOCAB = CONFIG["vocab_size"]
K = 3  # tokens a failing constraint lets through before it fails
BYSTANDERS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
    "penalised": SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True),
}


class FailingConstraint:
    """Allows every token; after K of them its mask, or its advance, fails as a grammar at a limit does."""

    def __init__(self, fails_in: str) -> None:
        self.fails_in = fails_in
        self.consumed = 0

    def allowed_tokens(self) -> torch.Tensor:
        if self.fails_in == "mask" and self.consumed == K:
            raise ConstraintError("the output constraint failed: lexer error: too many expressions constructed")
        if self.fails_in == "malformed mask" and self.consumed == K:
            return torch.ones(VOCAB + 1, dtype=torch.bool)  # the sampler would refuse the whole batch
        return torch.ones(VOCAB, dtype=torch.bool)

    def advance(self, token_id: int) -> None:
        if self.fails_in == "advance" and self.consumed == K:
            raise ConstraintError("the output constraint failed: lexer error: too many expressions constructed")
        self.consumed += 1

    def is_finished(self) -> bool:
        return False


def new_engine(**options) -> LLMEngine:
    return LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=64, **options).engine


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def add_bystanders(engine: LLMEngine) -> None:
    for index, (name, params) in enumerate(BYSTANDERS.items()):
        engine.add_request(
            EngineRequest(request_id=name, prompt_token_ids=prompt(20 + 7 * index, seed=index), params=params)
        )


def run(engine: LLMEngine) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """The bystanders' tokens in a batch of their own."""
    engine = new_engine()
    add_bystanders(engine)
    return {request_id: tokens(deltas) for request_id, deltas in run(engine).items()}


@pytest.mark.parametrize(
    ("fails_in", "kind"), [("advance", "constraint"), ("mask", "constraint"), ("malformed mask", "internal")]
)
def test_a_constraint_that_fails_after_k_tokens_ends_its_request_alone(reference, fails_in, kind):
    # given
    engine = new_engine()
    free_pages = engine.block_manager.num_free_pages
    add_bystanders(engine)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    add_constrained(
        engine,
        EngineRequest(request_id="doomed", prompt_token_ids=prompt(33, seed=9), params=params),
        FailingConstraint(fails_in),
    )

    # when
    deltas = run(engine)

    # then: K tokens, then an error delta with no token
    doomed = deltas.pop("doomed")
    assert [len(delta.token_ids) for delta in doomed] == [1] * K + [0]
    last = doomed[-1]
    assert last.finish_reason == "error" and last.failure.kind == kind
    if kind == "constraint":
        assert last.failure.message == "the output constraint failed: lexer error: too many expressions constructed"
    assert {request_id: tokens(stream) for request_id, stream in deltas.items()} == reference
    assert all(stream[-1].finish_reason == "length" for stream in deltas.values())
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.block_manager.num_free_pages == free_pages


def test_a_request_whose_detokenizing_raises_ends_alone():
    # given: a tiny model over SmolLM2's vocabulary, so requests have text
    engine = LLM(
        {**CONFIG, "vocab_size": 49152}, seed=0, kv_cache_bytes=1 << 24, tokenizer="smollm2-135m-instruct"
    ).engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(EngineRequest(request_id="fine", prompt_token_ids=[1, 2, 3, 4], params=params))
    engine.add_request(EngineRequest(request_id="broken", prompt_token_ids=[5, 6, 7], params=params))
    free_pages = engine.block_manager.num_free_pages
    text = engine.outputs.texts["broken"]
    appended = []

    def append(token_ids: list[int]) -> str | None:
        if appended:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")
        appended.extend(token_ids)
        return None

    text.append = append

    # when
    deltas = run(engine)

    # then
    broken = deltas["broken"]
    assert [len(delta.token_ids) for delta in broken] == [1, 0]
    assert broken[-1].finish_reason == "error" and broken[-1].failure.kind == "internal"
    assert "a detokenizer bug" in broken[-1].failure.message
    assert len(tokens(deltas["fine"])) == 8 and deltas["fine"][-1].finish_reason == "length"
    assert engine.requests == {} and engine.block_manager.num_free_pages == free_pages


def test_failing_a_request_from_outside_frees_it_and_names_the_reason():
    engine = new_engine()
    free_pages = engine.block_manager.num_free_pages
    engine.add_request(
        EngineRequest(
            request_id="r", prompt_token_ids=prompt(40, seed=1), params=SamplingParams(temperature=0.0, max_tokens=20)
        )
    )
    engine.step()

    delta = engine.fail_request("r", "its transfer broke", kind="internal")

    assert delta.finish_reason == "error" and delta.failure.message == "its transfer broke"
    assert engine.fail_request("r", "again") is None
    assert engine.requests == {} and engine.block_manager.num_free_pages == free_pages
    assert engine.step() == []


def test_a_handoff_whose_constraint_fails_on_its_first_token_changes_nothing():
    # given: a request prefilled on one engine
    prefill, decode = new_engine(), new_engine()
    prefill.add_request(
        EngineRequest(
            request_id="h",
            prompt_token_ids=prompt(30, seed=2),
            params=SamplingParams(temperature=0.0, max_tokens=5),
            prefill_only=True,
        )
    )
    while prefill.has_unfinished():
        prefill.step()
    handoff = prefill.export_kv("h").materialized()
    free_pages = decode.block_manager.num_free_pages

    class RefusesEverything(FailingConstraint):
        def advance(self, token_id: int) -> None:
            raise ConstraintError(f"token {token_id} is not allowed by the output constraint here")

    # when / then
    with pytest.raises(ConstraintError, match="not allowed"):
        hand_over(decode, handoff, RefusesEverything("advance"))
    assert decode.requests == {} and decode.block_manager.num_free_pages == free_pages
    assert decode.outputs.texts == {}
    hand_over(decode, handoff)  # the same handoff still fits: nothing was left behind
    assert "h" in decode.requests
