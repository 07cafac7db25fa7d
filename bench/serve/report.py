"""The run's JSON report: settings, aggregate metrics, prefix-cache hit rates, the first errors, and
one record per request (in dataset order)."""

from collections.abc import Mapping, Sequence

from bench.serve.client import RequestResult
from bench.serve.metrics import latencies_ms, summarize

ERRORS_SHOWN = 5


def build_report(
    *,
    settings: Mapping[str, object],
    results: Sequence[RequestResult],
    duration_s: float,
    slo_ms: Mapping[str, float],
    server_prefix_cache: Mapping[str, float | None],
    ideal_hit_rate: float | None,
) -> dict:
    return {
        "settings": dict(settings),
        **summarize(results, duration_s, slo_ms),
        "errors": first_errors(results),
        "prefix_cache": {
            **server_prefix_cache,
            "usage_hit_rate": usage_hit_rate(results),
            "ideal_hit_rate": ideal_hit_rate,
        },
        "requests": [_request_record(result) for result in results],
    }


def first_errors(results: Sequence[RequestResult]) -> list[str]:
    """The first few distinct error messages, in dataset order."""
    errors: list[str] = []
    for result in results:
        if result.error is not None and result.error not in errors:
            errors.append(result.error)
            if len(errors) == ERRORS_SHOWN:
                break
    return errors


def usage_hit_rate(results: Sequence[RequestResult]) -> float | None:
    """Cached over prompt tokens as the responses' usage reported them; None when none reported cached tokens."""
    reporting = [result for result in results if result.error is None and result.cached_tokens is not None]
    prompt_tokens = sum(result.prompt_tokens for result in reporting)
    return sum(result.cached_tokens for result in reporting) / prompt_tokens if prompt_tokens else None


def _request_record(result: RequestResult) -> dict:
    latencies = latencies_ms(result)
    return {
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "expected_output_tokens": result.expected_output_tokens,
        "cached_tokens": result.cached_tokens,
        "ttft_ms": latencies["ttft"],
        "tpot_ms": latencies["tpot"],
        "e2e_ms": latencies["e2e"],
        "itl_ms": [gap * 1000.0 for gap in result.itl_s],
        "error": result.error,
    }
