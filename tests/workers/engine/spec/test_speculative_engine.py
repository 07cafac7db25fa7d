"""Speculative decoding with the n-gram drafter end to end: the engine emits exactly the tokens it
emits without speculation (greedy, and seeded sampled requests), through stops, lengths, aborts,
preemption and prefix hits; sampled output keeps the target's distribution; bad settings are refused."""

import argparse
import math
import random
from collections import Counter

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.args import EngineArgs, add_engine_arguments
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest

CONFIG = TINY_CONFIGS["llama"]
# The same tiny model with SmolLM2's vocabulary and tokenizer, for text and stop strings.
WIDE_CONFIG = dict(CONFIG, vocab_size=49152)
SMOLLM2 = "smollm2-135m-instruct"


def repeating_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that quote themselves, so the drafter finds matches from the start."""
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(5 + i % 7)] * 3 for i in range(count)]


def pair(config=CONFIG, **settings) -> tuple[LLM, LLM]:
    """An engine without speculation and one with the n-gram drafter, otherwise alike."""
    return LLM(config, seed=0, **settings), LLM(config, seed=0, spec_method="ngram", **settings)


def token_ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


# A dense model, and one with sliding-window layers beside full ones (a window group of pages).
@pytest.mark.parametrize("model", ["llama", "qwen3_qknorm_layer_types"])
def test_greedy_tokens_are_the_same_with_lengths_ending_inside_accepted_runs(model):
    base, spec = pair(TINY_CONFIGS[model], kv_cache_bytes=1 << 24)
    prompts = repeating_prompts(12)
    params = [greedy(7 + 5 * i) for i in range(12)]

    expected = base.generate(prompts, params)
    results = spec.generate(prompts, params)

    assert token_ids(results) == token_ids(expected)
    assert [len(r.token_ids) for r in results] == [p.max_tokens for p in params]
    assert {r.finish_reason for r in results} == {"length"}
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    # Accepted drafts are tokens emitted without a step of their own.
    assert spec.engine.stats().steps.num_steps < base.engine.stats().steps.num_steps


def test_greedy_tokens_are_the_same_under_preemption():
    # 12 pages of 16 tokens for 8 requests of up to 71 tokens each: requests are preempted and recomputed.
    base, spec = pair(num_pages=13, max_num_batched_tokens=64)
    prompts = repeating_prompts(8, seed=1)
    params = greedy(40)

    expected = base.generate(prompts, params)
    results = spec.generate(prompts, params)

    assert token_ids(results) == token_ids(expected)
    assert spec.engine.stats().num_preemptions > 0
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0


def test_pages_keyed_while_speculating_give_prefix_hits_with_the_same_tokens():
    base, spec = pair(kv_cache_bytes=1 << 24)
    prompts = repeating_prompts(6, seed=2)
    first = token_ids(spec.generate(prompts, greedy(48)))
    assert first == token_ids(base.generate(prompts, greedy(48)))
    # The next turns quote the first ones' outputs: their prefixes are the pages computed while
    # speculating. A page keyed with a rejected draft's KV would change these tokens.
    follow_ups = [prompt + output[: 20 + 4 * i] for i, (prompt, output) in enumerate(zip(prompts, first))]
    cold = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, enable_prefix_caching=False)

    results = spec.generate(follow_ups, greedy(24))

    assert token_ids(results) == token_ids(cold.generate(follow_ups, greedy(24)))
    assert all(r.num_cached_tokens >= (len(p) // 16) * 16 for r, p in zip(results, prompts))
    assert any(r.num_cached_tokens > len(p) for r, p in zip(results, prompts))


def test_an_abort_during_speculation_leaves_the_others_identical():
    base, spec = pair(kv_cache_bytes=1 << 24)
    prompts = repeating_prompts(4, seed=3)
    expected = token_ids(base.generate(prompts, greedy(40)))
    engine = spec.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(index), prompt_token_ids=prompt, params=greedy(40)))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(4)}
    finish: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 4:
            delta = engine.abort_request("1")
            finish["1"] = delta.finish_reason
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                finish[delta.request_id] = delta.finish_reason
        steps += 1

    assert finish == {"0": "length", "1": "abort", "2": "length", "3": "length"}
    assert [outputs[str(i)] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    aborted = outputs["1"]
    assert 0 < len(aborted) < 40 and aborted == expected[1][: len(aborted)]
    assert engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def text_pair() -> tuple[LLM, LLM]:
    return pair(WIDE_CONFIG, kv_cache_bytes=1 << 24, tokenizer=SMOLLM2)


def looping_params(tokenizer, max_tokens: int, **fields) -> SamplingParams:
    """Greedy over a handful of words (a logit bias lifts them far above the rest): the tiny model
    loops through them, so drafts are accepted and stop strings can be found inside accepted runs."""
    words = [tokenizer.encode(word)[0] for word in (" red", " green", " blue", " red green")]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias={token: 30.0 for token in words}, **fields)


def test_stop_strings_and_end_of_sequence_inside_accepted_runs_end_as_without_speculation(text_pair):
    base, spec = text_pair
    tokenizer = spec.tokenizer
    prompt = tokenizer.encode("Colours: red green blue red green blue red green blue")
    plain = base.generate([prompt], looping_params(tokenizer, 48, ignore_eos=True))[0]
    # Stop strings taken from the middle and the end of what the model writes.
    stops = [plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 9], plain.text[-12:-3]]
    eos = next(iter(tokenizer.eos_token_ids))
    params = [
        looping_params(tokenizer, 48, stop=[stops[0]]),
        looping_params(tokenizer, 48, stop=[stops[1]], include_stop_str_in_output=True),
        # End of sequence as likely as the words: it ends the output wherever the model picks it.
        SamplingParams(
            temperature=0.0, max_tokens=48, logit_bias={**looping_params(tokenizer, 1).logit_bias, eos: 30.0}
        ),
        looping_params(tokenizer, 48, ignore_eos=True),
    ]

    expected = base.generate([prompt] * 4, params)
    results = spec.generate([prompt] * 4, params)

    assert [(r.token_ids, r.text, r.finish_reason) for r in results] == [
        (r.token_ids, r.text, r.finish_reason) for r in expected
    ]
    assert [r.finish_reason for r in results[:2]] == ["stop", "stop"]
    assert all(len(r.token_ids) < 48 for r in results[:2])
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0


def sampled(seed: int | None, max_tokens: int = 24, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=seed, **fields)


def test_seeded_sampled_requests_give_the_same_tokens_alone_in_a_batch_and_without_speculation():
    base, spec = pair(kv_cache_bytes=1 << 24)
    prompts = repeating_prompts(8, seed=4)
    # Biased towards the prompt's own tokens, so sampled continuations repeat it and drafts are accepted.
    params = [
        sampled(100 + i, logit_bias={t: 4.0 for t in set(p)}, frequency_penalty=0.2) for i, p in enumerate(prompts)
    ]

    alone = [spec.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    together = token_ids(spec.generate(prompts, params))

    assert together == alone
    assert together == token_ids(base.generate(prompts, params))
    stats = spec.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# A vocabulary of 16 tokens, so every token's probability is estimated from a few thousand draws.
SMALL_VOCAB = dict(CONFIG, vocab_size=16)
PATTERN_PROMPT = [0, 1, 2, 3] * 3 + [0, 1]
DRAWS = 1500


def chi_square_homogeneity(first: Counter, second: Counter) -> tuple[float, int]:
    """Pearson's statistic that two samples come from one distribution, and its degrees of freedom."""
    categories = sorted(set(first) | set(second))
    n1, n2 = sum(first.values()), sum(second.values())
    statistic = 0.0
    for category in categories:
        total = first[category] + second[category]
        for observed, n in ((first[category], n1), (second[category], n2)):
            expected = total * n / (n1 + n2)
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(categories) - 1


def chi_square_critical(degrees: int, z: float = 3.719) -> float:
    """The statistic's upper 1e-4 quantile (Wilson-Hilferty): a correct implementation fails one
    position's check about once in 10,000 runs."""
    a = 2 / (9 * degrees)
    return degrees * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.8),
    ],
    ids=["temperature", "top_p", "penalties"],
)
def test_sampled_tokens_keep_the_target_distribution_at_every_position(fields):
    # Biased towards the prompt's tokens, so drafts (from the prompt) are often, not always, accepted.
    bias = {0: 2.0, 1: 1.5, 2: 1.0, 3: 0.5}
    base, spec = pair(SMALL_VOCAB, kv_cache_bytes=1 << 24, max_num_seqs=256, max_num_batched_tokens=4096)

    def draws(llm: LLM, first_seed: int) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=5, ignore_eos=True, seed=first_seed + i, logit_bias=bias, **fields)
            for i in range(DRAWS)
        ]
        return token_ids(llm.generate([PATTERN_PROMPT] * DRAWS, params))

    # Other seeds on each side: the same seeds would give the very same tokens (see the test above).
    without = draws(base, 0)
    with_spec = draws(spec, DRAWS)

    for position in range(1, 5):  # the first token comes from the prompt's step, which never drafts
        statistic, degrees = chi_square_homogeneity(
            Counter(t[position] for t in without), Counter(t[position] for t in with_spec)
        )
        assert statistic < chi_square_critical(degrees), (position, statistic, degrees)
    stats = spec.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(spec_method="medusa"), "spec_method"),
        (dict(spec_budget="greedy"), "spec_budget"),
        (dict(spec_max_draft_tokens=0), "spec_max_draft_tokens"),
        (dict(spec_min_confidence=1.5), "spec_min_confidence"),
        (dict(spec_min_confidence=float("nan")), "spec_min_confidence"),
        (dict(spec_method="ngram", ep_size=2), "spec_method"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(settings, named):
    with pytest.raises(ValueError, match=named):
        EngineArgs(model="x", **settings)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(spec_method="draft"), "spec_method"),
        (dict(spec_method="ngram", spec_budget="dspark"), "spec_budget"),
    ],
)
def test_choices_not_built_yet_are_refused_at_start_naming_the_setting(settings, named):
    with pytest.raises(ValueError, match=named):
        LLM(CONFIG, seed=0, num_pages=8, **settings)


def test_the_settings_are_command_line_options():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    argv = ["--model", "x", "--spec-method", "ngram", "--spec-max-draft-tokens", "3", "--spec-min-confidence", "0.4"]

    args = EngineArgs.from_namespace(parser.parse_args(argv))

    assert (args.spec_method, args.spec_max_draft_tokens, args.spec_budget, args.spec_min_confidence) == (
        "ngram",
        3,
        "fixed",
        0.4,
    )
    assert args.to_argv() == ["--model=x", *[f"{a}={b}" for a, b in zip(argv[2::2], argv[3::2])]]
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x", "--spec-method", "medusa"])
