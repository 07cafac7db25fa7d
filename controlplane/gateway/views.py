"""The OpenAI- and Anthropic-compatible HTTP API. Each view runs the admission checks, calls the
module that does the work, and renders; every exception, a wrong method and a path no view serves
become errors in the protocol's shape."""

import functools
from collections.abc import Awaitable, Callable

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from controlplane.gateway.admission import admit_caller, admit_count, admit_generation
from controlplane.gateway.catalog import served_catalog
from controlplane.gateway.engine import engine_client
from controlplane.gateway.errors import GatewayError, as_gateway_error, error_response, unknown_path_protocol
from controlplane.gateway.generation import Generation
from controlplane.gateway.health import can_serve, health_report
from controlplane.gateway.usage import UsageCount, record_usage
from controlplane.telemetry.collector import record_finished_request
from controlplane.telemetry.metrics import exposition
from controlplane.telemetry.selectors import kv_store_gcs_reporting
from controlplane.telemetry.windows import RequestSample
from controlplane.topology.selectors import pool_scaling_summary, scaling_event_counts
from recipe.api import list_models
from workers.kvstore.block_hash import scoped_namespace

# Proxies must pass events on as they come.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

View = Callable[..., Awaitable[HttpResponse]]


def api_view(*methods: str) -> Callable[[View], View]:
    """A view of the API that takes `methods`; any other method gets a 405 in the protocol's shape."""

    def decorate(view: View) -> View:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *, protocol: str) -> HttpResponse:
            try:
                if request.method not in methods:
                    raise GatewayError(
                        "method_not_allowed",
                        f"Invalid method for URL ({request.method} {request.path}): use {' or '.join(methods)}.",
                        allow=methods,
                    )
                return await view(request, protocol=protocol)
            except Exception as error:
                return error_response(protocol, as_gateway_error(error))

        return wrapper

    return decorate


@api_view("POST")
async def generate(request: HttpRequest, *, protocol: str) -> HttpResponse:
    admission, prepared = await admit_generation(request, protocol=protocol)
    tenant_id = admission.tenant.pk
    share = admission.hold.fair_share
    try:
        generation = Generation(
            await engine_client(),
            prepared,
            protocol=protocol,
            cache_namespace=scoped_namespace(admission.tenant.prefix_cache_namespace, prepared.prompt_cache_key),
            hold=admission.hold,
            tenant=share.tenant,
            tenant_weight=share.weight,
            on_end=lambda usage: _generation_ended(tenant_id, usage),
        )
    except BaseException:
        # Until the generation exists; from then on it releases the hold when it ends.
        admission.hold.release()
        raise
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
            e2e_s=tuple(usage.e2e_s),
            tpot_s=tuple(usage.tpot_s),
            queue_s=tuple(usage.queue_s),
            prefill_s=tuple(usage.prefill_s),
            decode_s=tuple(usage.decode_s),
        )
    )


@api_view("POST")
async def count_tokens(request: HttpRequest, *, protocol: str) -> HttpResponse:
    return JsonResponse({"input_tokens": await admit_count(request)})


@api_view("GET")
async def models(request: HttpRequest, *, protocol: str) -> HttpResponse:
    await admit_caller(request)
    catalog = await served_catalog()
    return JsonResponse(list_models(catalog.models, catalog.created))


@csrf_exempt
async def unknown_path(request: HttpRequest) -> HttpResponse:
    """Any path under /v1/ that no endpoint serves."""
    protocol = unknown_path_protocol(request.path, request.headers.get("anthropic-version"))
    message = f"Invalid URL ({request.method} {request.path}): no such endpoint."
    return error_response(protocol, GatewayError("unknown_path", message))


@require_GET
async def healthz(request: HttpRequest) -> HttpResponse:
    """Unauthenticated, for load balancers: 200 while the workers sending heartbeats can serve a request."""
    workers = (await engine_client()).healthy_workers()
    return JsonResponse(health_report(workers), status=200 if can_serve(workers) else 503)


@require_GET
async def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics. Unauthenticated like /healthz: it is for a scraper on the operator network
    (keep it off the public listener there); it holds counts and latencies, no tenant or prompt data."""
    workers = (await engine_client()).healthy_workers()
    pools = await sync_to_async(pool_scaling_summary)()
    store_gcs = await sync_to_async(kv_store_gcs_reporting)()
    events = await sync_to_async(scaling_event_counts)()
    return HttpResponse(exposition(workers, pools, store_gcs, events), content_type=CONTENT_TYPE_PLAIN_0_0_4)
