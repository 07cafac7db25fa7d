import pytest

from workers.client.routing.balancers.decode import DecodeBalancer, new_workers


def balancer(kv_capacity=10_000, max_requests=64, per_request_s=1e-3, per_kv_token_s=1e-5):
    workers = new_workers(["d0", "d1"], kv_capacity=kv_capacity, max_requests=max_requests)
    return DecodeBalancer(workers, per_request_s=per_request_s, per_kv_token_s=per_kv_token_s)


def load(lb, worker_id, requests, kv):
    worker = lb.workers[worker_id]
    worker.num_requests, worker.kv_tokens, worker.reserved_kv_tokens = requests, kv, kv


def test_short_request_goes_where_requests_are_few_even_with_long_kv():
    lb = balancer()
    load(lb, "d0", requests=2, kv=6000)  # few requests, long KV
    load(lb, "d1", requests=20, kv=1000)  # many requests, short KV
    assert lb.choose(10, 0) == "d0"


def test_long_request_goes_where_total_kv_is_short():
    lb = balancer()
    load(lb, "d0", requests=2, kv=6000)
    load(lb, "d1", requests=20, kv=1000)
    assert lb.choose(2000, 0) == "d1"


def test_never_over_capacity_and_none_when_nobody_fits():
    lb = balancer(kv_capacity=1000)
    assert lb.choose(600, 100) is not None
    assert lb.choose(600, 100) is not None
    assert lb.choose(600, 100) is None  # 700 more fits neither worker
    for worker in lb.workers.values():
        assert worker.reserved_kv_tokens <= worker.kv_capacity


def test_max_requests_is_a_capacity_too():
    lb = balancer(max_requests=1)
    assert {lb.choose(1, 1), lb.choose(1, 1)} == {"d0", "d1"}
    assert lb.choose(1, 1) is None


def test_done_releases_the_reservation():
    lb = balancer(kv_capacity=1000)
    worker = lb.choose(800, 100)
    lb.on_progress(worker, 850)
    assert lb.workers[worker].kv_tokens == 850
    lb.on_done(worker, 800, 100)
    assert lb.workers[worker].num_requests == 0
    assert lb.workers[worker].reserved_kv_tokens == 0


def test_rejects_weights_that_score_nothing():
    with pytest.raises(ValueError):
        balancer(per_request_s=0.0, per_kv_token_s=0.0)
