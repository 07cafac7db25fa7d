"""The step time budget: each step's predicted time (by the fitted cost model) caps its prefill
chunks; decodes always run; a step always makes progress; outputs do not depend on the chunking."""

import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.sched.test_scheduler import make_request, rows, run_step
from workers.cost_model import PrefillCostModel
from workers.engine import LLM, SamplingParams
from workers.engine.kv.block_manager import BlockManager
from workers.engine.sched.scheduler import Scheduler
from workers.engine.sched.step_budget import StepBudget

# 1 s fixed, 1 s per token, nothing else: a budget of 1 + n seconds fits n tokens.
UNIT = PrefillCostModel(a=1.0, b=1.0, d=0.0, e=0.0)


def scheduler(budget_s: float, model: PrefillCostModel = UNIT) -> Scheduler:
    return Scheduler(
        BlockManager(num_pages=256, page_size=4),
        max_num_seqs=8,
        max_num_batched_tokens=1000,
        step_budget=StepBudget(model, budget_s),
    )


def test_a_prompt_is_chunked_to_what_the_budget_fits():
    planner = scheduler(budget_s=11.0)
    requests = {"a": make_request("a", 25)}
    planner.add(requests["a"])

    chunks = []
    while not requests["a"].output_token_ids:
        chunks.append([s.num_tokens for s in rows(run_step(planner, requests))])

    assert chunks == [[10], [10], [5]]


def test_context_makes_later_chunks_smaller():
    # 0.01 s per token of context per new token: attention over what is cached.
    planner = scheduler(budget_s=11.0, model=PrefillCostModel(a=1.0, b=1.0, d=0.0, e=0.01))
    requests = {"a": make_request("a", 60)}
    planner.add(requests["a"])

    sizes = [rows(run_step(planner, requests))[0].num_tokens for _ in range(3)]

    assert sizes[0] == 10 and sizes[0] > sizes[1] > sizes[2]


def test_decodes_always_run_and_prefill_gets_what_is_left():
    planner = scheduler(budget_s=5.0)
    requests = {"a": make_request("a", 4), "b": make_request("b", 30, start=100)}
    planner.add(requests["a"])
    run_step(planner, requests)  # a's whole prompt: 4 tokens, 4 s of the 4 available
    planner.add(requests["b"])

    second = run_step(planner, requests)

    # a decodes (1 s); b gets the 3 s left.
    assert [(s.request_id, s.num_tokens) for s in rows(second)] == [("a", 1), ("b", 3)]


def test_a_step_over_budget_still_makes_progress():
    planner = scheduler(budget_s=0.5)  # less than the fixed cost: nothing "fits"
    requests = {"a": make_request("a", 8), "b": make_request("b", 8, start=100)}
    for request in requests.values():
        planner.add(request)

    output = run_step(planner, requests)

    assert [(s.request_id, s.num_tokens) for s in rows(output)] == [("a", 1)]


def test_outputs_do_not_depend_on_the_budget_and_prediction_error_is_tracked():
    config = TINY_CONFIGS["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 90)), list(range(7, 40))]
    # A model that predicts 1 ms per token: a 20 ms budget makes chunks of about 20 tokens.
    model = PrefillCostModel(a=0.0, b=0.001, d=0.0, e=0.0)

    plain = LLM(config, seed=0, dtype=torch.float32)
    budgeted = LLM(config, seed=0, dtype=torch.float32, cost_model=model, step_budget_s=0.02)

    expected = [output.token_ids for output in plain.generate(prompts, params)]
    actual = [output.token_ids for output in budgeted.generate(prompts, params)]

    assert actual == expected
    p50, p90 = budgeted.engine.stats().cost_model_error
    assert 0 < p50 <= p90
    assert plain.engine.stats().cost_model_error == (0.0, 0.0)
