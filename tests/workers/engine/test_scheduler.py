from workers.engine.block_manager import BlockManager
from workers.engine.request import Request, RequestStatus
from workers.engine.sampling_params import SamplingParams
from workers.engine.sched.scheduler import Scheduler


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
    for s in output.scheduled:
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
        chunks.append([(s.start_position, len(s.token_ids), s.sample) for s in output.scheduled])
    assert chunks == [[(0, 10, False)], [(10, 10, False)], [(20, 5, True)]]


def test_running_requests_go_first_and_new_ones_fill_the_budget():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=8, max_num_batched_tokens=12)
    requests = {rid: make_request(rid, n, start=100 * i) for i, (rid, n) in enumerate([("a", 6), ("b", 20)])}
    for r in requests.values():
        scheduler.add(r)
    first = run_step(scheduler, requests)
    assert [(s.request_id, len(s.token_ids)) for s in first.scheduled] == [("a", 6), ("b", 6)]
    second = run_step(scheduler, requests)
    # a decodes one token, b continues its prefill with the rest of the budget.
    assert [(s.request_id, len(s.token_ids), s.start_position) for s in second.scheduled] == [("a", 1, 6), ("b", 11, 6)]


def test_max_num_seqs_caps_admission():
    scheduler = Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=2, max_num_batched_tokens=100)
    requests = {rid: make_request(rid, 3, start=10 * i) for i, rid in enumerate("abc")}
    for r in requests.values():
        scheduler.add(r)
    output = run_step(scheduler, requests)
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
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
    assert [s.request_id for s in output.scheduled] == ["a"]
    b = requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.pages == []
    assert len(b.output_token_ids) == 2  # kept, to be recomputed
    assert scheduler.waiting[0] is b
    scheduler.remove(requests["a"])
    output = run_step(scheduler, requests)
    # b comes back; its keyed prompt pages are still cached, so only the tail is recomputed.
    (s,) = output.scheduled
    assert s.request_id == "b" and s.start_position == 8 and len(s.token_ids) == 5 and s.sample


def test_a_lone_request_that_cannot_grow_preempts_itself_without_crashing():
    scheduler = Scheduler(BlockManager(num_pages=3, page_size=4), max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 8)}
    scheduler.add(requests["a"])
    run_step(scheduler, requests)
    output = run_step(scheduler, requests)  # needs a third page that does not exist
    assert output.preempted == ["a"] and output.scheduled == []


def test_remove_frees_pages():
    manager = BlockManager(num_pages=16, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=100)
    requests = {"a": make_request("a", 9)}
    scheduler.add(requests["a"])
    run_step(scheduler, requests)
    assert manager.num_free_pages == 12
    scheduler.remove(requests["a"])
    assert manager.num_free_pages == 15 and not scheduler.has_unfinished()
