"""One tenant flooding an engine: another tenant's requests are admitted by fair share, in their own
arrival order, and a long prefill leaves room in each step for them."""

import random

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.sched.test_scheduler import rows, run_step
from workers.engine import LLM, SamplingParams
from workers.engine.kv.block_manager import BlockManager
from workers.engine.request import Request
from workers.engine.sched.scheduler import Scheduler
from workers.protocol.engine_request import EngineRequest

SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
FLOOD = 64
PROMPT_TOKENS = 120


def tenant_request(rid: str, tenant: str, length: int, *, start: int = 0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(start, start + length)),
        params=SamplingParams(),
        max_tokens=8,
        hash_extra=b"m",
        tenant=tenant,
    )


@pytest.mark.parametrize(("short_tokens", "long_chunk"), [(6, 14), (15, 5), (30, 0)])
def test_a_long_prefill_leaves_another_tenants_waiting_request_the_tokens_it_needs(short_tokens, long_chunk):
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=20)
    requests = {"long": tenant_request("long", "a", 100)}
    scheduler.add(requests["long"])
    run_step(scheduler, requests)
    requests["short"] = tenant_request("short", "b", short_tokens, start=200)
    scheduler.add(requests["short"])

    output = run_step(scheduler, requests)

    # the long prefill goes on with what is left of the budget (nothing, for a prompt past it)
    expected = [("long", long_chunk)] if long_chunk else []
    assert [(row.request_id, row.num_tokens) for row in rows(output)] == [*expected, ("short", min(short_tokens, 20))]


def test_a_long_prefill_of_the_same_tenant_keeps_the_whole_budget():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=20)
    requests = {"long": tenant_request("long", "a", 100)}
    scheduler.add(requests["long"])
    run_step(scheduler, requests)
    requests["short"] = tenant_request("short", "a", 6, start=200)
    scheduler.add(requests["short"])

    output = run_step(scheduler, requests)

    assert [(row.request_id, row.num_tokens) for row in rows(output)] == [("long", 20)]


@pytest.fixture
def llm() -> LLM:
    # Prefill chunks of 64 tokens: each long prompt takes two steps, so the flood queues for a while.
    return LLM(TINY_CONFIGS["llama"], seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=64, max_num_seqs=16)


def admission_order(llm: LLM, flood_tenant: str, b_weight: int = 1) -> tuple[list[str], int]:
    """Tenant A queues FLOOD long prompts and runs a step; then B queues 4 prompts as long. Steps
    until every request finished; returns the order in which requests were admitted (joined the
    running batch), and how many had been admitted when B's arrived."""
    engine = llm.engine
    rng = random.Random(0)

    def add(rid: str, tenant: str, weight: int = 1) -> None:
        prompt = [rng.randrange(128) for _ in range(PROMPT_TOKENS)]
        engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=prompt, params=SHORT, tenant=tenant, tenant_weight=weight)
        )

    order: list[str] = []

    def step() -> None:
        engine.step()
        order.extend(request.request_id for request in engine.scheduler.running if request.request_id not in order)

    for i in range(FLOOD):
        add(f"a{i}", flood_tenant)
    step()
    admitted_before_b = len(order)
    for i in range(4):
        add(f"b{i}", "b", b_weight)
    while engine.has_unfinished():
        step()
    return order, admitted_before_b


def test_a_flood_from_one_tenant_leaves_another_tenants_requests_in_order_within_the_fair_share(llm):
    order, admitted_before_b = admission_order(llm, "a")

    after_b = order[admitted_before_b:]
    b_positions = [after_b.index(f"b{i}") for i in range(4)]
    # B's requests in the order B sent them...
    assert b_positions == sorted(b_positions)
    # ...and each waited for at most one of A's per request of B's ahead of it: A and B alternate,
    # though 63 of A's requests were queued before B's.
    a_ahead = [position - i for i, position in enumerate(b_positions)]
    assert all(ahead <= i + 1 for i, ahead in enumerate(a_ahead)), a_ahead
    assert len(order) == FLOOD + 4


def test_a_tenants_weight_buys_it_that_many_admissions_per_admission_of_the_other(llm):
    order, admitted_before_b = admission_order(llm, "a", b_weight=4)

    after_b = order[admitted_before_b:]
    # All four of B's before a second one of A's.
    assert sum(rid.startswith("a") for rid in after_b[: after_b.index("b3")]) <= 1


def test_behind_its_own_flood_a_tenant_waits_in_arrival_order(llm):
    # The same flood sent as B's own requests: B's four are behind all of them, as they would be
    # behind A's if the queue ignored tenants.
    order, _ = admission_order(llm, "b")

    assert order[-4:] == ["b0", "b1", "b2", "b3"]
