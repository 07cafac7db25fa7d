"""DSpark's measured valve (spec.valve): windows of speculating and plain steps, the faster phase
running longer each time it wins, the other probed between; and an engine whose valve switches
phases, letting plain steps run ahead of their tokens, emits the tokens it emits without speculation."""

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.spec.test_speculation_budgets import CHEAP_DRAFTS
from tests.workers.engine.spec.test_speculative_engine import greedy, repeating_prompts
from workers.engine import LLM
from workers.engine.spec.valve import ThroughputValve

WINDOW = 4


def phases(valve: ThroughputValve, steps: int, tokens_per_second) -> str:
    """The phase of each of `steps` steps ('s' speculating, 'p' plain), each step taking 1 s and
    emitting what `tokens_per_second(drafts, step)` says."""
    seen = []
    for step in range(steps):
        seen.append("s" if valve.drafts else "p")
        valve.record(1.0, tokens_per_second(valve.drafts, step))
    return "".join(seen)


def test_when_plain_steps_are_faster_speculation_is_only_probed_ever_more_rarely():
    valve = ThroughputValve(margin=0.02, window=WINDOW, max_run=16)

    seen = phases(valve, 4 + 4 + 4 + 4 + 8 + 4 + 16 + 4 + 16, lambda drafts, _: 10 if drafts else 20)

    # Speculation first, a plain probe wins and runs, speculation probed between doubling plain runs.
    assert seen == "s" * 4 + "p" * 4 + "p" * 4 + "s" * 4 + "p" * 8 + "s" * 4 + "p" * 16 + "s" * 4 + "p" * 16
    assert valve.winner is False


def test_when_speculation_is_faster_it_keeps_running_and_plain_is_probed():
    valve = ThroughputValve(margin=0.02, window=WINDOW, max_run=64)

    seen = phases(valve, 4 + 4 + 8 + 4 + 16, lambda drafts, _: 30 if drafts else 20)

    assert seen == "s" * 4 + "p" * 4 + "s" * 8 + "p" * 4 + "s" * 16
    assert valve.winner is True


def test_speculation_must_beat_plain_by_the_margin():
    valve = ThroughputValve(margin=0.1, window=WINDOW)

    phases(valve, 8, lambda drafts, _: 21 if drafts else 20)  # 5% faster: not enough

    assert valve.drafts is False and valve.winner is False


def test_a_change_in_which_phase_is_faster_flips_the_winner_at_the_next_probe():
    valve = ThroughputValve(margin=0.02, window=WINDOW, max_run=64)

    # Speculation wins for its first 24 steps; from step 24 on plain decoding is faster.
    seen = phases(
        valve,
        4 + 4 + 8 + 4 + 16 + 4,
        lambda drafts, step: (30 if drafts else 20) if step < 24 else (10 if drafts else 20),
    )

    assert seen.endswith("s" * 16 + "p" * 4)  # the probe after the long run...
    assert valve.winner is False  # ...won, though the run's own rate was a mix


def test_a_window_needs_two_steps():
    with pytest.raises(ValueError, match="at least 2 steps"):
        ThroughputValve(margin=0.02, window=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs on the CPU under Triton's interpreter")
def test_steps_run_ahead_in_plain_phases_and_the_tokens_are_those_without_speculation():
    pytest.importorskip("triton")
    prompts = repeating_prompts(4, seed=3)
    params = [greedy(20 + 3 * i) for i in range(4)]
    settings = {"seed": 0, "kv_cache_bytes": 1 << 22, "attention_backend": "triton", "async_scheduling": True}
    reference = LLM(TINY_CONFIGS["llama"], **settings)
    spec = LLM(TINY_CONFIGS["llama"], **settings, spec_method="ngram", spec_budget="dspark", cost_model=CHEAP_DRAFTS)
    valve = spec.engine.scheduler.speculator.valve
    valve.window = valve.run = 3  # short windows: both phases come round several times
    valve._current.steps_left = 3

    results = spec.generate(prompts, params)

    assert [r.token_ids for r in results] == [r.token_ids for r in reference.generate(prompts, params)]
    assert valve.rates[True] is not None and valve.rates[False] is not None  # both phases ran
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
