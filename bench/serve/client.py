"""One streamed request, timed: first text, the gaps between text chunks, the end, and the usage the
server reported. A failure of any kind (HTTP status, connection, a stream cut short or malformed)
becomes the result's error instead of an exception, so one bad request never ends a run."""

import json
import time
from dataclasses import dataclass, field

import httpx

from bench.serve.api_protocols import GenerationSettings, StreamingApi, Usage
from bench.serve.datasets.request import BenchRequest
from bench.serve.sse import sse_events

ERROR_BODY_CHARS = 300


@dataclass
class RequestResult:
    prompt_tokens: int  # the server's count where it reported one, else the dataset's
    expected_output_tokens: int
    output_tokens: int = 0  # from usage where reported, else the number of text chunks
    cached_tokens: int | None = None  # prompt tokens the server says it served from its cache
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None


async def send_request(
    http: httpx.AsyncClient, api: StreamingApi, request: BenchRequest, settings: GenerationSettings, api_key: str | None
) -> RequestResult:
    result = RequestResult(prompt_tokens=len(request.prompt_ids), expected_output_tokens=request.output_len)
    body = api.body(request, settings)
    start = time.perf_counter()
    try:
        async with http.stream("POST", api.path, json=body, headers=api.headers(api_key)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_error_text(await response.aread())}"
                return result
            await _read_stream(api, response, result, start)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    except (json.JSONDecodeError, AttributeError, TypeError) as error:
        # A body that is not the protocol's JSON (a proxy's page, a truncated line).
        result.error = f"malformed stream event: {error}"
    return result


async def _read_stream(api: StreamingApi, response: httpx.Response, result: RequestResult, start: float) -> None:
    chunks = 0
    last_text_at = None
    usage = Usage()
    # Read to the end of the body, past the end marker: a client that hangs up there cuts short the
    # server's work after the marker (our gateway records usage and metrics then) and loses the connection.
    async for event in sse_events(response.aiter_lines()):
        update = api.read(event)
        now = time.perf_counter()
        if update.error is not None:
            result.error = f"stream error: {update.error}"
            return
        if update.text:
            chunks += 1
            if last_text_at is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last_text_at)
            last_text_at = now
        if update.usage is not None:
            usage = _merged(usage, update.usage)
        if update.done and result.e2e_s is None:
            result.e2e_s = now - start
    if result.e2e_s is None:
        result.error = "the stream ended before its end marker"
        return
    result.output_tokens = usage.output_tokens if usage.output_tokens is not None else chunks
    if usage.prompt_tokens is not None:
        result.prompt_tokens = usage.prompt_tokens
    result.cached_tokens = usage.cached_tokens


def _merged(earlier: Usage, later: Usage) -> Usage:
    return Usage(
        prompt_tokens=later.prompt_tokens if later.prompt_tokens is not None else earlier.prompt_tokens,
        output_tokens=later.output_tokens if later.output_tokens is not None else earlier.output_tokens,
        cached_tokens=later.cached_tokens if later.cached_tokens is not None else earlier.cached_tokens,
    )


def _error_text(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return message or body.decode("utf-8", "replace")[:ERROR_BODY_CHARS]
