"""What the engine measures of where its time goes, on a tiny random-weight model on the CPU: every
step counted (its tokens, its seconds in buckets), and each finished request's queue, prefill and
decode times here. Only counts and the order of times are asserted, never their size."""

import random
import time

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import hand_over
from workers.engine import LLM, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.outputs import RequestDelta
from workers.engine.step_stats import STEP_SECONDS_BOUNDS, STEP_TOKENS_BOUNDS, Buckets
from workers.protocol.engine_request import EngineRequest

CONFIG = TINY_CONFIGS["llama"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


def engine(**options) -> LLMEngine:
    return LLM(CONFIG, **{"seed": 0, "kv_cache_bytes": 1 << 22, **options}).engine


def run(engine: LLMEngine) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def test_buckets_count_each_value_at_or_below_its_bound():
    buckets = Buckets((1.0, 2.0))

    for value in (0.5, 1.0, 1.5, 2.0, 3.0):
        buckets.observe(value)

    assert buckets.counts == [2, 2, 1]
    assert buckets.total == 8.0


def test_every_step_is_counted_with_the_tokens_it_ran():
    llm = engine(max_num_batched_tokens=32)
    for index, length in enumerate((5, 40, 21)):  # 40 tokens prefill in two chunks
        llm.add_request(
            EngineRequest(request_id=str(index), prompt_token_ids=prompt(length, seed=index), params=greedy(6))
        )

    run(llm)
    steps = llm.stats().steps

    # Every token that ran through the model was in a counted step, and at least one step made each
    # of the 6 tokens of the longest-waiting request.
    assert steps.tokens.total == llm.stats().num_computed_tokens
    assert sum(steps.tokens.counts) == steps.num_steps >= 6
    assert len(steps.seconds.counts) == len(STEP_SECONDS_BOUNDS) + 1
    assert len(steps.tokens.counts) == len(STEP_TOKENS_BOUNDS) + 1
    assert steps.seconds.total >= 0.0
    assert steps.tokens.counts[-1] == 0  # no step ran more than 16384 tokens


def test_a_finished_request_reports_its_queue_prefill_and_decode_within_its_whole_time():
    llm = engine()
    started = time.monotonic()
    llm.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt(30), params=greedy(5)))

    deltas = run(llm)["r"]
    elapsed = time.monotonic() - started

    assert [delta.phase_times for delta in deltas[:-1]] == [None] * 4  # only the last output carries them
    times = deltas[-1].phase_times
    assert min(times.queue_s, times.prefill_s, times.decode_s) >= 0.0
    assert times.queue_s + times.prefill_s + times.decode_s <= elapsed


def test_a_request_that_waits_for_a_full_batch_reports_the_whole_first_request_as_its_queue():
    llm = engine(max_num_seqs=1)
    llm.add_request(EngineRequest(request_id="first", prompt_token_ids=prompt(20), params=greedy(8)))
    llm.add_request(EngineRequest(request_id="second", prompt_token_ids=prompt(20, seed=1), params=greedy(2)))

    deltas = run(llm)
    first, second = deltas["first"][-1].phase_times, deltas["second"][-1].phase_times

    # The second is scheduled only once the first has finished.
    assert second.queue_s >= first.prefill_s + first.decode_s


def test_an_aborted_request_that_never_ran_reports_no_phase():
    llm = engine()
    llm.add_request(EngineRequest(request_id="gone", prompt_token_ids=prompt(10), params=greedy(4)))

    delta = llm.abort_request("gone")

    assert delta.finish_reason == "abort"
    assert delta.phase_times is None


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_a_prefill_engine_reports_queue_and_prefill_and_the_decode_engine_reports_decode(max_tokens):
    prefill, decode = engine(), engine()
    prefill.add_request(
        EngineRequest(request_id="r", prompt_token_ids=prompt(25), params=greedy(max_tokens), prefill_only=True)
    )

    (last_prefill,) = run(prefill)["r"]
    if max_tokens == 1:
        # Its first token ended it: nothing to hand off, and its decode took no time here.
        assert last_prefill.finish_reason == "length"
        assert last_prefill.phase_times.decode_s >= 0.0
        return
    assert last_prefill.finish_reason == "transfer"
    hand_over(decode, prefill.export_kv("r").materialized())
    prefill.release_transfer("r")
    last_decode = run(decode)["r"][-1]

    sent = last_prefill.phase_times
    assert sent.queue_s >= 0.0 and sent.prefill_s >= 0.0 and sent.decode_s is None
    continued = last_decode.phase_times
    assert continued.queue_s is None and continued.prefill_s is None and continued.decode_s >= 0.0
