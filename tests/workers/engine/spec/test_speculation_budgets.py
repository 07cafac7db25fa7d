"""Speculation with the draft-model drafter and the DSpark budget, through the engine: output tokens
are those of decoding without speculation; a draft model that is the target has every draft
accepted; DSpark verifies what its step-time curve pays for (and nothing when a draft token costs
more than it can gain), records each step's budget, and calibrates its confidence; settings that
cannot work are refused by name."""

import json
import random

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.cost_model import PrefillCostModel
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import OutputConstraintSpec

SMOLLM2 = "smollm2-135m-instruct"
CONFIG = dict(TINY_CONFIGS["llama"], vocab_size=49152)
SETTINGS = dict(seed=0, kv_cache_bytes=1 << 24, tokenizer=SMOLLM2, max_model_len=256)
# A draft token costs a twentieth of a step: verifying likely drafts pays.
CHEAP_DRAFTS = PrefillCostModel(a=1e-2, b=5e-4, d=0.0, e=0.0)
# A draft token costs ten steps: no draft can pay for itself.
DEAR_DRAFTS = PrefillCostModel(a=1e-3, b=1e-2, d=0.0, e=0.0)


def repeating_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 2000) for _ in range(6 + i % 5)] * 3 for i in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return token_ids(LLM(CONFIG, **SETTINGS).generate(repeating_prompts(6), greedy(24)))


def test_the_target_as_its_own_draft_model_has_every_draft_accepted(expected):
    spec = LLM(CONFIG, **SETTINGS, spec_method="draft", spec_draft_model=CONFIG, spec_max_draft_tokens=4)

    assert token_ids(spec.generate(repeating_prompts(6), greedy(24))) == expected
    stats = spec.engine.stats().spec_decode
    assert stats.method == "draft" and stats.num_drafts > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.accepted_per_position[0] == stats.num_drafts


def test_another_draft_model_drafts_and_the_tokens_stay_the_target_s(expected):
    drafter = dict(CONFIG, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    spec = LLM(CONFIG, **SETTINGS, spec_method="draft", spec_draft_model=drafter)

    assert token_ids(spec.generate(repeating_prompts(6), greedy(24))) == expected
    stats = spec.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_real_smollm2_with_a_tiny_random_draft_model_gives_its_own_greedy_tokens():
    chat = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    base = LLM(SMOLLM2, seed=0, kv_cache_bytes=1 << 26, max_model_len=256)
    prompt = base.tokenizer.encode(base.tokenizer.apply_chat_template(chat), allow_special=True)
    drafter = dict(CONFIG, num_hidden_layers=1)
    spec = LLM(
        SMOLLM2, seed=0, kv_cache_bytes=1 << 26, max_model_len=256, spec_method="draft", spec_draft_model=drafter
    )

    [expected] = base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    [result] = spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))

    assert result.outputs[0].token_ids == expected.outputs[0].token_ids
    assert spec.engine.stats().spec_decode.num_draft_tokens > 0


def test_dspark_verifies_drafts_when_they_pay_records_its_budget_and_calibrates(expected):
    spec = LLM(CONFIG, **SETTINGS, spec_method="ngram", spec_budget="dspark", cost_model=CHEAP_DRAFTS)

    assert token_ids(spec.generate(repeating_prompts(6), greedy(24))) == expected
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    steps = sum(stats.budget.counts)
    assert steps > 0 and stats.budget.total == stats.num_draft_tokens
    planner = spec.engine.scheduler.speculator.planner
    assert planner.calibrator.calibration_error().outcomes > 0


def test_dspark_s_valve_verifies_nothing_when_no_draft_can_pay(expected):
    spec = LLM(CONFIG, **SETTINGS, spec_method="ngram", spec_budget="dspark", cost_model=DEAR_DRAFTS)
    prompts = repeating_prompts(6)
    spec.generate(prompts[:1], greedy(8))  # the first steps verify every draft, to learn their odds
    learned = spec.engine.stats().spec_decode.num_draft_tokens

    assert token_ids(spec.generate(prompts, greedy(24))) == expected
    stats = spec.engine.stats().spec_decode
    assert stats.num_draft_tokens == learned  # nothing verified since
    assert stats.budget.counts[0] > 0  # steps whose budget was 0


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(spec_method="draft"), "spec_method 'draft' needs spec_draft_model"),
        (dict(spec_method="ngram", spec_budget="dspark"), "spec_budget 'dspark' needs a cost_model"),
    ],
)
def test_speculation_that_cannot_run_is_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(CONFIG, **SETTINGS, **settings)


def test_a_json_constrained_request_drafts_what_its_grammar_allows_and_gives_its_own_tokens():
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
        "additionalProperties": False,
    }
    example = '{"name": "Ada Lovelace", "city": "London", "age": 36}'
    chat = [{"role": "user", "content": f"Copy this JSON exactly: {example}"}]
    engines = [
        LLM(SMOLLM2, seed=0, kv_cache_bytes=1 << 26, max_model_len=256, **spec)
        for spec in ({}, dict(spec_method="ngram", spec_max_draft_tokens=4))
    ]
    prompt = engines[0].tokenizer.encode(engines[0].tokenizer.apply_chat_template(chat), allow_special=True)
    outputs = []
    for llm in engines:
        llm.engine.add_request(
            EngineRequest(
                request_id="json",
                prompt_token_ids=prompt,
                params=SamplingParams(temperature=0.0, max_tokens=40),
                constraint=OutputConstraintSpec("json", json.dumps(schema)),
            )
        )
        tokens = []
        while llm.engine.has_unfinished():
            for delta in llm.engine.step():
                tokens += delta.token_ids
        outputs.append(tokens)

    assert outputs[1] == outputs[0]
    json.loads(engines[0].tokenizer.decode(outputs[0]))  # the grammar held
    stats = engines[1].engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
