"""The numbers a run reports, from its request results: latency distributions in milliseconds,
throughputs, and goodput under service-level objectives.

- TTFT: send to the first text chunk. ITL: gaps between text chunks (one per chunk, not per token).
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- Goodput: completed requests that meet every given objective (ms, keys `ttft`, `tpot`, `e2e`), per
  second of the run; a request without a TPOT (one token) meets a TPOT objective.
"""

from collections.abc import Mapping, Sequence

import numpy as np

from bench.serve.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2e")
PERCENTILES = {"median": 50, "p95": 95, "p99": 99}


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation between order statistics), in ms; None when empty."""
    if not values_s:
        return {"mean": None, **{name: None for name in PERCENTILES}}
    values_ms = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean": float(values_ms.mean()),
        **{name: float(np.percentile(values_ms, q)) for name, q in PERCENTILES.items()},
    }


def tpot_s(result: RequestResult) -> float | None:
    if result.error is not None or result.ttft_s is None or result.e2e_s is None or result.output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def latencies_ms(result: RequestResult) -> dict[str, float | None]:
    """One request's TTFT, TPOT and E2E in ms."""
    values = {"ttft": result.ttft_s, "tpot": tpot_s(result), "e2e": result.e2e_s}
    return {name: value * 1000.0 if value is not None else None for name, value in values.items()}


def meets_slo(result: RequestResult, slo_ms: Mapping[str, float]) -> bool:
    if result.error is not None:
        return False
    latencies = latencies_ms(result)
    for name, limit in slo_ms.items():
        value = latencies[name]
        if value is None and name == "tpot":
            continue
        if value is None or value > limit:
            return False
    return True


def summarize(results: Sequence[RequestResult], duration_s: float, slo_ms: Mapping[str, float]) -> dict:
    done = [result for result in results if result.error is None]
    input_tokens = sum(result.prompt_tokens for result in done)
    output_tokens = sum(result.output_tokens for result in done)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": _per_second(len(done), duration_s),
        "input_token_throughput": _per_second(input_tokens, duration_s),
        "output_token_throughput": _per_second(output_tokens, duration_s),
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([value for r in done if (value := tpot_s(r)) is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "goodput": _goodput(done, duration_s, slo_ms),
    }


def _goodput(done: Sequence[RequestResult], duration_s: float, slo_ms: Mapping[str, float]) -> dict | None:
    if not slo_ms:
        return None
    good = sum(meets_slo(result, slo_ms) for result in done)
    return {"slo_ms": dict(slo_ms), "good_requests": good, "requests_per_s": _per_second(good, duration_s)}


def _per_second(count: int, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None
