"""The OpenAI- and Anthropic-compatible HTTP API. Each view runs the admission checks, calls the
module that does the work, and renders; every exception becomes an error in its protocol's shape."""

import asyncio
import functools
from collections.abc import Awaitable, Callable

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from controlplane.gateway.admission import admit, admit_caller, prepare
from controlplane.gateway.catalog import served_catalog
from controlplane.gateway.engine import engine_client
from controlplane.gateway.errors import as_gateway_error, error_response
from controlplane.gateway.generation import Generation
from controlplane.gateway.usage import UsageCount, record_usage
from controlplane.telemetry.collector import record_finished_request
from controlplane.telemetry.metrics import exposition
from controlplane.telemetry.windows import RequestSample
from recipe.api import count_tokens as recipe_count_tokens
from recipe.api import list_models

# Proxies must pass events on as they come.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

View = Callable[..., Awaitable[HttpResponse]]


def api_view(view: View) -> View:
    @csrf_exempt
    @functools.wraps(view)
    async def wrapper(request: HttpRequest, *, protocol: str) -> HttpResponse:
        try:
            return await view(request, protocol=protocol)
        except Exception as error:
            return error_response(protocol, as_gateway_error(error))

    return wrapper


@require_POST
@api_view
async def generate(request: HttpRequest, *, protocol: str) -> HttpResponse:
    admission = await admit(request)
    prepared = await prepare(admission, protocol=protocol)
    tenant_id = admission.tenant.pk
    generation = Generation(
        await engine_client(),
        prepared,
        protocol=protocol,
        cache_namespace=admission.tenant.prefix_cache_namespace,
        on_end=lambda usage: _generation_ended(tenant_id, usage),
    )
    if prepared.stream:
        await generation.start_stream()
        return StreamingHttpResponse(generation.stream(), content_type="text/event-stream", headers=SSE_HEADERS)
    return JsonResponse(await generation.body())


async def _generation_ended(tenant_id: int, usage: UsageCount) -> None:
    await record_usage(tenant_id, usage)
    record_finished_request(
        RequestSample(
            ttft_s=usage.ttft_s,
            inter_token_s=tuple(usage.inter_token_s),
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            generation_tokens=usage.completion_tokens,
            finish_reasons=tuple(usage.finish_reasons.values()),
        )
    )


@require_POST
@api_view
async def count_tokens(request: HttpRequest, *, protocol: str) -> HttpResponse:
    admission = await admit(request)
    input_tokens = await asyncio.to_thread(recipe_count_tokens, admission.body, admission.catalog.models)
    return JsonResponse({"input_tokens": input_tokens})


@require_GET
@api_view
async def models(request: HttpRequest, *, protocol: str) -> HttpResponse:
    await admit_caller(request)
    catalog = await served_catalog()
    return JsonResponse(list_models(catalog.models, catalog.created))


@require_GET
async def healthz(request: HttpRequest) -> HttpResponse:
    """Unauthenticated, for load balancers: 200 while at least one engine worker sends heartbeats and
    takes requests (a draining or drained worker is listed but does not count)."""
    workers = (await engine_client()).healthy_workers()
    serving = any(worker.state == "ready" for worker in workers)
    payload = {
        "status": "ok" if serving else "unavailable",
        "workers": [
            {
                "worker_id": worker.worker_id,
                "model": worker.model,
                "role": worker.role,
                "state": worker.state,
                "num_running": worker.num_running,
                "num_waiting": worker.num_waiting,
                "kv_usage": worker.kv_usage,
            }
            for worker in workers
        ],
    }
    return JsonResponse(payload, status=200 if serving else 503)


@require_GET
async def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics. Unauthenticated like /healthz: it is for a scraper on the operator network
    (keep it off the public listener there); it holds counts and latencies, no tenant or prompt data."""
    workers = (await engine_client()).healthy_workers()
    return HttpResponse(exposition(workers), content_type=CONTENT_TYPE_PLAIN_0_0_4)
