import pytest

from bench.serve.client import RequestResult
from bench.serve.metrics import distribution_ms, meets_slo, summarize, tpot_s


def done(ttft_s, e2e_s, output_tokens, itl_s=(), prompt_tokens=10):
    return RequestResult(
        prompt_tokens=prompt_tokens,
        expected_output_tokens=output_tokens,
        output_tokens=output_tokens,
        ttft_s=ttft_s,
        e2e_s=e2e_s,
        itl_s=list(itl_s),
    )


def test_distribution_in_ms_interpolates_percentiles():
    stats = distribution_ms([0.001 * value for value in range(1, 101)])  # 1 .. 100 ms

    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p95"] == pytest.approx(95.05)
    assert stats["p99"] == pytest.approx(99.01)
    assert distribution_ms([]) == {"mean": None, "median": None, "p95": None, "p99": None}


def test_tpot_spreads_the_time_after_the_first_token_over_the_others():
    assert tpot_s(done(ttft_s=0.2, e2e_s=1.0, output_tokens=5)) == pytest.approx(0.2)
    assert tpot_s(done(ttft_s=0.2, e2e_s=0.2, output_tokens=1)) is None
    failed = RequestResult(prompt_tokens=1, expected_output_tokens=5, error="HTTP 500: boom")
    assert tpot_s(failed) is None


def test_slo_needs_every_objective_and_a_single_token_meets_tpot():
    fast = done(ttft_s=0.1, e2e_s=0.5, output_tokens=5)  # tpot 100 ms
    single = done(ttft_s=0.1, e2e_s=0.1, output_tokens=1)

    assert meets_slo(fast, {"ttft": 200, "tpot": 100})
    assert not meets_slo(fast, {"ttft": 200, "tpot": 99})
    assert not meets_slo(fast, {"e2e": 400})
    assert meets_slo(single, {"tpot": 1})
    assert not meets_slo(RequestResult(prompt_tokens=1, expected_output_tokens=1, error="x"), {"ttft": 1e9})


def test_summary_counts_only_completed_requests():
    results = [
        done(ttft_s=0.1, e2e_s=0.5, output_tokens=5, itl_s=[0.1, 0.1, 0.1, 0.1], prompt_tokens=100),
        done(ttft_s=0.3, e2e_s=0.7, output_tokens=3, itl_s=[0.2, 0.2], prompt_tokens=50),
        RequestResult(prompt_tokens=70, expected_output_tokens=4, error="ConnectError: refused"),
    ]

    summary = summarize(results, duration_s=2.0, slo_ms={"ttft": 200})

    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (150, 8)
    assert summary["request_throughput"] == 1.0
    assert summary["input_token_throughput"] == 75.0 and summary["output_token_throughput"] == 4.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["median"] == pytest.approx(150.0)  # 100 ms and 200 ms
    assert summary["itl_ms"]["mean"] == pytest.approx(400.0 / 3)
    assert summary["goodput"] == {"slo_ms": {"ttft": 200}, "good_requests": 1, "requests_per_s": 0.5}
    assert summarize(results, duration_s=2.0, slo_ms={})["goodput"] is None
