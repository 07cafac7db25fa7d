from dataclasses import dataclass

from workers.engine.kv.block_manager import BlockManager
from workers.engine.request import Request, RequestStatus
from workers.engine.sched.output import SchedulerOutput
from workers.engine.sched.scheduler import Scheduler
from workers.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class Row:
    """One sequence of a step, as the scheduler output's parallel lists give it."""

    request_id: str
    num_tokens: int
    start: int
    sample: bool


def rows(output: SchedulerOutput) -> list[Row]:
    return [
        Row(*row)
        for row in zip(
            output.request_ids, output.num_scheduled_tokens, output.num_computed_tokens, output.sample, strict=True
        )
    ]


def make_request(rid: str, length: int, start: int = 0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(start, start + length)),
        params=SamplingParams(),
        max_tokens=64,
        hash_extra=b"m",
    )


def run_step(scheduler: Scheduler, requests: dict[str, Request], sampled: int = 7):
    """Schedule, then do what the engine does with the result (a fixed sampled token)."""
    output = scheduler.schedule()
    scheduler.finish_step(output, requests)
    for s in rows(output):
        if s.sample:
            requests[s.request_id].output_token_ids.append(sampled)
    return output


def test_chunked_prefill_respects_the_token_budget():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=10)
    requests = {"a": make_request("a", 25)}
    scheduler.add(requests["a"])
    chunks = []
    while not requests["a"].output_token_ids:
        output = run_step(scheduler, requests)
        chunks.append([(s.start, s.num_tokens, s.sample) for s in rows(output)])
    assert chunks == [[(0, 10, False)], [(10, 10, False)], [(20, 5, True)]]


def test_running_requests_go_first_and_new_ones_fill_the_budget():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=12)
    requests = {rid: make_request(rid, n, start=100 * i) for i, (rid, n) in enumerate([("a", 6), ("b", 20)])}
    for r in requests.values():
        scheduler.add(r)
    first = run_step(scheduler, requests)
    assert [(s.request_id, s.num_tokens) for s in rows(first)] == [("a", 6), ("b", 6)]
    second = run_step(scheduler, requests)
    # a decodes one token, b continues its prefill with the rest of the budget.
    assert [(s.request_id, s.num_tokens, s.start) for s in rows(second)] == [("a", 1, 6), ("b", 11, 6)]


def test_max_num_seqs_caps_admission():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=2, max_num_batched_tokens=100)
    requests = {rid: make_request(rid, 3, start=10 * i) for i, rid in enumerate("abc")}
    for r in requests.values():
        scheduler.add(r)
    output = run_step(scheduler, requests)
    assert [s.request_id for s in rows(output)] == ["a", "b"]
    assert requests["c"].status is RequestStatus.WAITING


def test_out_of_pages_preempts_the_latest_request_and_it_recomputes_later():
    # 6 usable pages of 4 tokens.
    scheduler = Scheduler(BlockManager(num_pages=7, page_size=4), max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 11), "b": make_request("b", 11, start=50)}
    for r in requests.values():
        scheduler.add(r)
    run_step(scheduler, requests)  # both admitted: 3 pages each, 12 slots for 11 + 1 tokens
    run_step(scheduler, requests)  # both decode their 12th token into the last free slot
    output = run_step(scheduler, requests)  # each needs a 4th page: b is preempted for a
    assert output.preempted == ["b"]
    assert [s.request_id for s in rows(output)] == ["a"]
    b = requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.pages == []
    assert len(b.output_token_ids) == 2  # kept, to be recomputed
    assert scheduler.waiting[0] is b
    scheduler.remove(requests["a"])
    output = run_step(scheduler, requests)
    # b comes back; its keyed prompt pages are still cached, so only the tail is recomputed.
    (s,) = rows(output)
    assert s.request_id == "b" and s.start == 8 and s.num_tokens == 5 and s.sample


def test_a_lone_request_that_cannot_grow_preempts_itself_without_crashing():
    scheduler = Scheduler(BlockManager(num_pages=3, page_size=4), max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 8)}
    scheduler.add(requests["a"])
    run_step(scheduler, requests)
    output = run_step(scheduler, requests)  # needs a third page that does not exist
    assert output.preempted == ["a"] and rows(output) == []


def test_remove_frees_pages():
    manager = BlockManager(num_pages=16, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 9)}
    scheduler.add(requests["a"])
    run_step(scheduler, requests)
    assert manager.num_free_pages == 12
    scheduler.remove(requests["a"])
    assert manager.num_free_pages == 15 and not scheduler.has_unfinished()


def test_a_request_is_described_in_full_once_then_only_by_the_pages_it_gains():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 6)}
    scheduler.add(requests["a"])

    first = run_step(scheduler, requests)  # 6 prompt tokens: pages 1 and 2
    second = run_step(scheduler, requests)  # token 7 fits page 2
    third = run_step(scheduler, requests)  # token 8 fits page 2
    fourth = run_step(scheduler, requests)  # token 9 needs a third page

    (new,) = first.new_requests
    assert new.request_id == "a" and new.block_ids == (requests["a"].pages[:2],)
    assert new.prompt_token_ids is requests["a"].prompt_token_ids  # shared, not copied
    assert new.output_token_ids is requests["a"].output_token_ids
    assert first.new_block_ids == {}
    assert (second.new_requests, second.new_block_ids) == ([], {})
    assert (third.new_requests, third.new_block_ids) == ([], {})
    assert fourth.new_requests == [] and fourth.new_block_ids == {"a": (requests["a"].pages[2:],)}


def test_a_preempted_request_is_described_in_full_again_when_it_comes_back():
    scheduler = Scheduler(BlockManager(num_pages=7, page_size=4), max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 11), "b": make_request("b", 11, start=50)}
    for r in requests.values():
        scheduler.add(r)
    run_step(scheduler, requests)
    run_step(scheduler, requests)
    preempting = run_step(scheduler, requests)
    assert preempting.preempted == ["b"] and preempting.new_block_ids == {"a": (requests["a"].pages[3:],)}
    scheduler.remove(requests["a"])

    back = run_step(scheduler, requests)

    assert [new.request_id for new in back.new_requests] == ["b"]
    assert back.new_requests[0].block_ids == (requests["b"].pages,)


def test_a_continued_request_is_described_in_full_at_its_first_step():
    manager = BlockManager(num_pages=64, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=100)
    request = make_request("a", 6)
    request.output_token_ids.append(3)
    assert manager.allocate(request, request.num_tokens)
    request.num_computed_tokens = 6  # the prefill engine computed the prompt; the sampled token is next
    scheduler.add_running(request)

    output = run_step(scheduler, {"a": request})

    assert rows(output) == [Row("a", 1, 6, True)]
    assert [new.request_id for new in output.new_requests] == ["a"]


def test_lookahead_slots_are_covered_by_pages():
    scheduler = Scheduler(
        BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=100, num_lookahead_tokens=3
    )
    requests = {"a": make_request("a", 5)}
    scheduler.add(requests["a"])

    first = run_step(scheduler, requests)
    assert first.num_lookahead_tokens == 3
    assert len(requests["a"].pages) == 2  # 5 tokens + 3 lookahead slots
    run_step(scheduler, requests)  # token 6 at position 5: slots through position 8 needed
    assert len(requests["a"].pages) == 3
