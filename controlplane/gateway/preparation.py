"""Where a request body is parsed, rendered and tokenized: never on the event loop, and never where
one tenant's large bodies hold up everyone.

The native code that does most of this (json, the recipe's conversion, tokenizers' encode) holds the
GIL for as long as it runs, so a thread does not keep the event loop free: a 3.9 MB count_tokens body
holds it for ~10 s of tokenizing on a 2-core machine, and 4 MB of small messages for ~0.4 s of
json.loads alone. So bodies up to SLUICE_PREPARE_INLINE_MAX_BYTES (a few milliseconds of work) are
prepared in a few gateway threads, and larger ones, and any with an image to fetch or decode, first
in prepare processes (prepare_pool), each job within a CPU budget. A count_tokens answer comes whole
from there. A generation's prepared request holds its response builder, which cannot leave the
process that made it: the process refuses a body that is invalid or over the context window, and a
valid one is prepared again in a gateway thread, which the context window bounds (the recipe's
tokenizer releases the GIL while it encodes), with the images the process read: an image is fetched
and decoded once.

Both queues are fair between tenants (fair_work, weighted by fair_share_weight, each job costing its
body's bytes), so a tenant's backlog of large bodies delays another tenant's by about one job each.
"""

import asyncio
import contextlib
import dataclasses
import threading

from django.conf import settings

from controlplane.gateway.catalog import load_catalog
from controlplane.gateway.fair_work import FairWorkers
from controlplane.gateway.prepare_jobs import PrepareJob, run_job
from controlplane.gateway.prepare_pool import prepare_pool
from controlplane.gateway.tenant_caps import TenantHold
from recipe.api import PreparedRequest, RequestImage

_lock = threading.Lock()
_threads: FairWorkers | None = None
_processes: FairWorkers | None = None


def _run_here(job: PrepareJob) -> PreparedRequest | int:
    return run_job(job, load_catalog())


def _thread_workers() -> FairWorkers:
    global _threads
    with _lock:
        if _threads is None:
            _threads = FairWorkers(
                settings.SLUICE_PREPARE_THREADS, lambda: contextlib.nullcontext(_run_here), name="prepare-thread"
            )
        return _threads


def _process_workers() -> FairWorkers:
    global _processes
    with _lock:
        if _processes is None:
            _processes = prepare_pool()
        return _processes


def start_preparation() -> None:
    """Start the threads and the prepare processes now, so that the first large body finds them warm."""
    _thread_workers()
    _process_workers()


def close_preparation() -> None:
    global _threads, _processes
    with _lock:
        workers, _threads, _processes = [_threads, _processes], None, None
    for each in workers:
        if each is not None:
            each.close()


async def prepare_generation(body: bytes, *, protocol: str, hold: TenantHold) -> PreparedRequest:
    """`hold`, the call's on its tenant's caps, places its jobs in the fair queues."""
    job = PrepareJob("generation", protocol, body, settings.SLUICE_REQUEST_LIMITS)
    if _needs_process(job):
        images = await _done_by(_process_workers(), job, hold)
        job = dataclasses.replace(job, images=images)
    return await _done_by(_thread_workers(), job, hold)


async def prepare_count(body: bytes, *, hold: TenantHold) -> int:
    job = PrepareJob("count_tokens", "messages.count_tokens", body, settings.SLUICE_REQUEST_LIMITS)
    return await _done_by(_process_workers() if _needs_process(job) else _thread_workers(), job, hold)


def _needs_process(job: PrepareJob) -> bool:
    """Large bodies, and any that may hold an image: fetching and decoding images (recipe.images) is
    work for a prepare process, whatever the body's size. A body that spells `image` with JSON escapes
    is prepared in a thread, under the same limits."""
    return len(job.body) > settings.SLUICE_PREPARE_INLINE_MAX_BYTES or b"image" in job.body


async def _done_by(
    workers: FairWorkers, job: PrepareJob, hold: TenantHold
) -> PreparedRequest | int | tuple[RequestImage, ...]:
    share = hold.fair_share
    work = workers.submit(job, tenant=share.tenant, weight=share.weight, cost=len(job.body))
    try:
        return await asyncio.wrap_future(work)
    except asyncio.CancelledError:
        # The client went away. Work not yet started is dropped; work that runs keeps counting
        # against the tenant's cap until it ends.
        if not work.done():
            hold.release_after(work)
        raise
