"""One benchmark run against a server: the prefix-cache counters before, the load, the counters after."""

from dataclasses import dataclass

import httpx

from bench.serve.api_protocols import GenerationSettings, StreamingApi
from bench.serve.client import RequestResult, send_request
from bench.serve.datasets.request import BenchRequest
from bench.serve.load import run_load
from bench.serve.server_metrics import prefix_cache_report, scrape_after_run, scrape_prefix_cache


@dataclass(frozen=True)
class RunOutcome:
    results: list[RequestResult]
    duration_s: float
    server_prefix_cache: dict[str, float | None]


async def run_benchmark(
    requests: list[BenchRequest],
    offsets: list[float | None],
    *,
    api: StreamingApi,
    server_url: str,
    api_key: str | None,
    generation: GenerationSettings,
    max_concurrency: int | None,
    request_timeout_s: float,
    progress: bool,
) -> RunOutcome:
    # One connection per request that may be in flight, so no request waits for a connection.
    connections = max_concurrency or len(requests)
    async with httpx.AsyncClient(
        base_url=server_url,
        timeout=httpx.Timeout(request_timeout_s, pool=None),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    ) as http:
        before = await scrape_prefix_cache(http)
        results, duration_s = await run_load(
            requests,
            offsets,
            lambda request: send_request(http, api, request, generation, api_key),
            max_concurrency=max_concurrency,
            progress=progress,
        )
        prompt_tokens = sum(result.prompt_tokens for result in results if result.error is None)
        after = await scrape_after_run(http, before, prompt_tokens)
    return RunOutcome(results, duration_s, prefix_cache_report(before, after))
