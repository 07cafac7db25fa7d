from workers.client.routing.balancers.baselines import (
    LeastRequestsDecode,
    LeastRequestsPrefill,
    RoundRobinDecode,
    RoundRobinPrefill,
)
from workers.client.routing.balancers.decode import new_workers


def test_round_robin_prefill_cycles_whatever_the_load():
    lb = RoundRobinPrefill(["a", "b", "c"])
    assert [lb.choose(8000 if i == 0 else 10, 0) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_requests_prefill_counts_requests_not_tokens():
    lb = LeastRequestsPrefill(["a", "b"])
    assert lb.choose(8000, 0) == "a"
    assert lb.choose(10, 0) == "b"
    assert lb.choose(10, 0) == "a"  # tie: the first
    lb.on_done("b")
    assert lb.choose(10, 0) == "b"


def test_round_robin_decode_skips_workers_without_room():
    lb = RoundRobinDecode(new_workers(["a", "b", "c"], kv_capacity=100, max_requests=8))
    assert lb.choose(90, 0) == "a"
    assert lb.choose(10, 0) == "b"
    assert lb.choose(95, 0) == "c"
    assert lb.choose(50, 0) == "b"  # a is full
    assert lb.choose(60, 0) is None


def test_least_requests_decode_ignores_kv_but_respects_capacity():
    lb = LeastRequestsDecode(new_workers(["a", "b"], kv_capacity=1000, max_requests=8))
    assert lb.choose(900, 0) == "a"
    assert lb.choose(10, 0) == "b"
    assert lb.choose(10, 0) == "a"  # a has 900 KV tokens, but ties on requests go first
    assert lb.choose(200, 0) == "b"
    lb.on_done("a", 900, 0)
    assert lb.workers["a"].num_requests == 1
