"""The engine's waiting queue: preempted requests first, then tenants by fair share."""

from workers.engine.request import Request
from workers.engine.sched.fair_share import FORGET_IDLE_AFTER, FairShareClock
from workers.engine.sched.waiting import WaitingQueue
from workers.protocol.sampling_params import SamplingParams


def make_request(rid: str, tenant: str = "", *, length: int = 10, weight: int = 1) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(length)),
        params=SamplingParams(),
        max_tokens=8,
        hash_extra=b"m",
        tenant=tenant,
        tenant_weight=weight,
    )


def drain(queue: WaitingQueue) -> list[str]:
    order = []
    while queue:
        order.append(queue.pop(0).request_id)
    return order


def test_one_tenant_is_served_in_arrival_order():
    queue = WaitingQueue()
    for rid, length in [("a", 50), ("b", 5), ("c", 500), ("d", 1)]:
        queue.add(make_request(rid, "acme", length=length))

    assert drain(queue) == ["a", "b", "c", "d"]


def test_a_tenant_arriving_behind_a_flood_alternates_with_it():
    # given: eight requests of one tenant, then three of another
    queue = WaitingQueue()
    for i in range(8):
        queue.add(make_request(f"a{i}", "a"))
    queue.pop(0)  # a0 is admitted: the virtual time is a0's start
    for i in range(3):
        queue.add(make_request(f"b{i}", "b"))

    # then: b0 starts at the virtual time, ahead of a's backlog, and the two alternate
    assert drain(queue) == ["b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5", "a6", "a7"]


def test_weights_share_admissions_in_proportion():
    queue = WaitingQueue()
    for i in range(6):
        queue.add(make_request(f"a{i}", "a"))
    for i in range(9):
        queue.add(make_request(f"b{i}", "b", weight=3))

    order = drain(queue)

    assert "".join(rid[0] for rid in order[:12]) == "abbbabbbabbb"


def test_a_tenant_pays_for_its_tokens():
    # given: a's requests are ten times as long as b's
    queue = WaitingQueue()
    for i in range(3):
        queue.add(make_request(f"a{i}", "a", length=100))
    for i in range(12):
        queue.add(make_request(f"b{i}", "b", length=10))

    order = drain(queue)

    # then: b gets ten requests through for each of a's
    assert order[:13] == ["a0", *[f"b{i}" for i in range(10)], "a1", "b10"]


def test_preempted_requests_come_first_the_latest_at_the_front():
    queue = WaitingQueue()
    queue.add(make_request("new", "a"))
    queue.push_front(make_request("preempted-first", "b"))
    queue.push_front(make_request("preempted-last", "b"))

    assert [queue[i].request_id for i in range(len(queue))] == ["preempted-last", "preempted-first", "new"]
    assert drain(queue) == ["preempted-last", "preempted-first", "new"]


def test_taking_a_request_from_the_middle_keeps_the_others_in_place():
    # The scheduler skips a request whose store blocks are being fetched and admits the next one.
    queue = WaitingQueue()
    requests = [make_request(rid, "a") for rid in ["fetching", "next", "last"]]
    for request in requests:
        queue.add(request)

    assert queue.pop(1).request_id == "next"
    assert [request.request_id for request in queue] == ["fetching", "last"]


def test_remove_and_membership():
    queue = WaitingQueue()
    kept, removed, preempted = make_request("kept", "a"), make_request("removed", "b"), make_request("p", "a")
    for request in (kept, removed):
        queue.add(request)
    queue.push_front(preempted)

    queue.remove(removed)
    queue.remove(preempted)

    assert removed not in queue and preempted not in queue and kept in queue
    assert len(queue) == 1


def test_the_clock_forgets_idle_tenants_but_not_a_debt():
    clock = FairShareClock()
    clock.served(clock.start_tag("busy", cost=10_000, weight=1))
    for i in range(3 * FORGET_IDLE_AFTER):
        # a steady tenant moves the virtual time on; each passing tenant is idle after one item
        clock.served(clock.start_tag("steady", cost=1, weight=1))
        clock.served(clock.start_tag(f"passing-{i}", cost=1, weight=1))

    assert len(clock._finish_tags) <= 2 * FORGET_IDLE_AFTER
    # "busy" still owes for its 10,000 tokens: its next item starts after them
    assert clock.start_tag("busy", cost=1, weight=1) == 10_000
