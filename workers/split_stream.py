"""One request split between a prefill and a decode worker, seen by the gateway as one stream.

An attempt: the router picks the decode worker first (it must have room for the request's KV), then
the prefill worker. The decode worker is told to expect the request (so it knows where its outputs
go) before the prefill worker gets it with the decode worker's transfer endpoint. The prefill
worker's only output is the first token, with finish_reason "transfer", which the stream passes on
without it; the decode worker's outputs follow. The two come over different sockets, so a decode
output that overtakes the prefill's is held back until the prefill's has been passed on.

Deadlines (workers.prefill_deadlines) follow the request's predicted prefill time: the decode worker
waits for the KV as long as the prefill and the transfer are predicted to take, with margins, and
the stream waits that long for the decode worker's first output once the prefill's is out.

Failures. A worker that refuses as draining, a transfer that fails (the prefill worker could not
send, the decode worker could not assemble or admit it, or no decode output came within the
transfer deadline), and a worker that goes away (its heartbeats stop, or it reports it failed) end
the attempt, and the request runs again from the start, on other workers than the one that failed
(or whole on one worker when no other prefill or decode worker is left). Outputs the client already has
are skipped: the retry recomputes them and checks that it produced the same tokens, which a greedy
or seeded request always does. An unseeded sampled request that has already streamed tokens cannot
be continued that way: its stream fails with WorkerUnavailableError, as do all after MAX_ATTEMPTS.
A worker that went away may have been brought down by this very request, so that failure is retried
once, and not at all for a request that was in flight on a failed worker before
(workers.crash_suspects): it fails "worker_failed" instead of taking the next worker down too.
A prefill worker that is full (overloaded) is back-pressure, not a failure: the request waits and
tries again, for up to CAPACITY_WAIT_S, before it is refused "overloaded".
Whatever ends a stream, each worker that may still hold the request is told to abort it, so both
sides free its KV.
"""

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from workers.block_hash import namespace_extra
from workers.engine_client import (
    EngineClient,
    RequestRejectedError,
    StreamItem,
    WorkerLink,
    WorkerUnavailableError,
)
from workers.entrypoint.prefix_match import store_hit_tokens
from workers.entrypoint.router import DecodeLoad, expected_peak
from workers.protocol import AbortRequest, ExpectTransferRequest, GenerateError, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# Longest a request waits for a decode worker with room for its KV, or for a prefill worker to take
# it, before it is refused "overloaded".
CAPACITY_WAIT_S = 10.0
CAPACITY_POLL_S = 0.05
PREFILL, DECODE = "prefill", "decode"
TRANSFER = "transfer"  # the phase between the prefill's last output and the decode's first


class _Retry(Exception):
    """The attempt failed in a way another attempt may not: `avoid` names a worker not to try again;
    `busy`: the prefill worker was full (it caps the prefills awaiting transfer), so the attempt waits
    and does not count; `crashed`: a worker holding the request went away."""

    def __init__(
        self, reason: str, avoid: WorkerLink | None = None, *, busy: bool = False, crashed: bool = False
    ) -> None:
        super().__init__(reason)
        self.avoid = avoid
        self.busy = busy
        self.crashed = crashed


class _Tagged:
    """A link's sink for a split request: its messages go to the one queue, tagged with the side."""

    __slots__ = ("queue", "side")

    def __init__(self, queue: asyncio.Queue[tuple[str, StreamItem]], side: str) -> None:
        self.queue = queue
        self.side = side

    def put_nowait(self, item: StreamItem) -> None:
        self.queue.put_nowait((self.side, item))


class SplitStream:
    def __init__(self, client: EngineClient, request: GenerateRequest) -> None:
        self.client = client
        self.request = request
        self.delivered: list[int] = []  # tokens the consumer has been given
        self.avoid: set[WorkerLink] = set()  # workers that failed this request
        self.num_split_attempts = 0
        self.crashed = False  # a worker went away while it held this request

    async def outputs(self) -> AsyncIterator[GenerateOutput]:
        params = self.request.params
        replayable = params.is_greedy or params.seed is not None
        failure: _Retry | None = None
        attempts = 0
        busy_until = time.monotonic() + CAPACITY_WAIT_S
        while attempts < MAX_ATTEMPTS:
            attempts += 1
            replayed = 0  # tokens of this attempt that the consumer already has
            try:
                async for output in self._attempt():
                    tokens = output.token_ids
                    if replayed < len(self.delivered):
                        if tokens != self.delivered[replayed : replayed + len(tokens)]:
                            raise WorkerUnavailableError(
                                f"request {self.request.request_id} was retried ({failure}) and the retry "
                                f"produced other tokens than the {len(self.delivered)} already streamed"
                            )
                        replayed += len(tokens)
                        if output.finish_reason is None:
                            continue
                        output = msgspec.structs.replace(output, token_ids=[], text="", logprobs=[])
                    self.delivered.extend(output.token_ids)
                    replayed = len(self.delivered)
                    yield output
                    if output.finish_reason is not None:
                        return
                return
            except _Retry as retry:
                if retry.busy:
                    if time.monotonic() > busy_until:
                        raise RequestRejectedError("overloaded", str(retry)) from None
                    attempts -= 1
                    await asyncio.sleep(CAPACITY_POLL_S)
                    continue
                failure = retry
                if retry.crashed:
                    self._count_crash(retry)
                if retry.avoid is not None:
                    self.avoid.add(retry.avoid)
                if self.delivered and not replayable:
                    raise WorkerUnavailableError(
                        f"{retry}; request {self.request.request_id} had streamed {len(self.delivered)} "
                        "tokens and, sampled without a seed, cannot be continued elsewhere"
                    ) from None
                log.warning("retrying request %s: %s", self.request.request_id, retry)
        raise WorkerUnavailableError(f"request {self.request.request_id} failed {MAX_ATTEMPTS} times; last: {failure}")

    def _count_crash(self, retry: _Retry) -> None:
        """The request was in flight on a worker that went away: tried again once at most, and not
        at all when it (or the same request sent before) was in flight on one that did before."""
        suspected_before = self.client.crash_suspects.record(self.request)
        if self.crashed or suspected_before:
            raise RequestRejectedError(
                "worker_failed",
                f"request {self.request.request_id} was in flight on engine workers that failed; "
                f"not retried again (last: {retry})",
            ) from None
        self.crashed = True

    async def _attempt(self) -> AsyncIterator[GenerateOutput]:
        chosen = await self._choose()
        if chosen is None:
            # No decode worker left to try: one worker runs the request whole.
            try:
                async for output in self.client.generate_whole(self.request):
                    yield output
            except WorkerUnavailableError as error:
                raise _Retry(str(error), crashed=True) from None
            except RequestRejectedError as error:
                if error.kind != "worker_failed":
                    raise
                raise _Retry(str(error), crashed=True) from None
            return
        async for output in self._split(*chosen):
            yield output

    async def _choose(self) -> tuple[WorkerLink, WorkerLink, float, int] | None:
        """(prefill, decode, the prefill compute charged to the router, the prompt's tokens in the
        store), or None when no prefill or no decode worker but those that failed this request is ready."""
        router, request = self.client.router, self.request
        deadline = time.monotonic() + CAPACITY_WAIT_S
        while True:
            ready = self.client.ready_links()
            prefills = [link for link in ready if link.role == PREFILL and link not in self.avoid]
            decodes = [link for link in ready if link.role == DECODE and link not in self.avoid]
            if not prefills or not decodes:
                return None
            by_key = {link.request_endpoint: link for link in decodes}
            prompt, output = expected_peak(request, min(link.heartbeat.max_model_len for link in decodes))
            loads = [
                DecodeLoad(link.request_endpoint, link.heartbeat, link.num_decode_requests, link.reserved_kv_tokens)
                for link in decodes
            ]
            key = router.choose_decode(loads, prompt, output)
            if key is not None:
                break
            if time.monotonic() > deadline:
                raise RequestRejectedError(
                    "overloaded", f"no decode worker has room for {prompt + output} tokens of KV"
                )
            await asyncio.sleep(CAPACITY_POLL_S)
        hit = await self._store_hit_tokens(prefills[0])
        prefill_key, cost = router.choose_prefill(
            [(link.request_endpoint, link.heartbeat) for link in prefills], prompt, hit
        )
        prefill = next(link for link in prefills if link.request_endpoint == prefill_key)
        return prefill, by_key[key], cost, hit

    async def _store_hit_tokens(self, prefill: WorkerLink) -> int:
        """The prompt's hit length in the global KV store (0 when this client cannot read its index)."""
        index, beat = self.client.store_index, prefill.heartbeat
        if index is None or not beat.kv_block_tokens:
            return 0
        extra = namespace_extra(beat.kv_model_id, self.request.cache_namespace)
        try:
            # The index may be a network round trip (Redis): not on the event loop.
            return await asyncio.to_thread(
                store_hit_tokens, index, self.request.prompt_token_ids, block_tokens=beat.kv_block_tokens, extra=extra
            )
        except Exception as error:
            log.warning("reading the KV store index failed; routing as a miss: %s", error)
            return 0

    async def _split(
        self, prefill: WorkerLink, decode: WorkerLink, cost: float, hit: int
    ) -> AsyncIterator[GenerateOutput]:
        # Each attempt goes to the workers under an id of its own: the answer to an abort sent when an
        # earlier attempt ended (a decode worker replies to it) must not end this one.
        self.num_split_attempts += 1
        request_id = f"{self.request.request_id}#{self.num_split_attempts}"
        client, request = self.client, msgspec.structs.replace(self.request, request_id=request_id)
        peak = sum(expected_peak(request, decode.heartbeat.max_model_len))
        prompt_tokens = len(request.prompt_token_ids)
        deadlines = client.deadline_model.deadlines(
            prompt_tokens=prompt_tokens,
            cached_tokens=hit,
            queued_tokens=prefill.queued_prefill_tokens,
            prediction_error=prefill.heartbeat.cost_model_error_p90,
        )
        queued = max(prompt_tokens - hit, 0)
        prefill.queued_prefill_tokens += queued
        decode.num_decode_requests += 1
        decode.reserved_kv_tokens += peak
        queue: asyncio.Queue[tuple[str, StreamItem]] = asyncio.Queue()
        sinks = {prefill: _Tagged(queue, PREFILL), decode: _Tagged(queue, DECODE)}
        for link, sink in sinks.items():
            link.streams[request_id] = sink
        holding = {prefill, decode}  # workers that may still hold the request: aborted if we leave early
        charged = True  # the prefill's predicted compute still counts against the prefill worker
        phase = PREFILL
        early: collections.deque[GenerateOutput] = collections.deque()  # decode outputs ahead of the prefill's
        try:
            await client.send(decode, ExpectTransferRequest(request_id, request.constraint, deadlines.handoff_s))
            routed = msgspec.structs.replace(request, decode_endpoint=decode.heartbeat.transfer_endpoint)
            await client.send(prefill, routed)
            while True:
                if early and phase != PREFILL:
                    side, item = DECODE, early.popleft()
                else:
                    side, item = await self._next(queue, phase, decode, deadlines.transfer_s)
                if isinstance(item, WorkerUnavailableError | GenerateError):
                    holding.discard(prefill if side == PREFILL else decode)
                    self._fail(side, item, prefill, decode)
                if side == DECODE and phase == PREFILL:
                    early.append(item)
                    continue
                if side == PREFILL:
                    if charged:
                        client.router.prefill_done(prefill.request_endpoint, cost)
                        prefill.queued_prefill_tokens -= queued
                        charged = False
                    if item.finish_reason == TRANSFER:
                        phase = TRANSFER  # the prefill worker may still be sending: it stays in `holding`
                        item = msgspec.structs.replace(item, finish_reason=None)
                elif phase == TRANSFER:
                    phase = DECODE
                    # The prefill worker's part is over: its failing no longer concerns this request.
                    del prefill.streams[request_id]
                    holding.discard(prefill)
                if item.finish_reason is not None:
                    holding.discard(prefill if side == PREFILL else decode)
                yield msgspec.structs.replace(item, request_id=self.request.request_id)
                if item.finish_reason is not None:
                    return
        finally:
            if charged:
                client.router.prefill_done(prefill.request_endpoint, cost)
                prefill.queued_prefill_tokens -= queued
            for link, sink in sinks.items():
                if link.streams.get(request_id) is sink:
                    del link.streams[request_id]
            for link in holding:
                client.send_now(link, AbortRequest(request_id))
            decode.num_decode_requests -= 1
            decode.reserved_kv_tokens -= peak

    async def _next(
        self, queue: asyncio.Queue[tuple[str, StreamItem]], phase: str, decode: WorkerLink, transfer_s: float
    ) -> tuple[str, StreamItem]:
        if phase != TRANSFER:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), transfer_s)
        except TimeoutError:
            raise _Retry(f"decode worker {decode.request_endpoint} sent nothing for {transfer_s:g} s") from None

    def _fail(
        self, side: str, item: WorkerUnavailableError | GenerateError, prefill: WorkerLink, decode: WorkerLink
    ) -> None:
        """Raise what a worker's error or disappearance means for the attempt."""
        link = prefill if side == PREFILL else decode
        if isinstance(item, WorkerUnavailableError) or item.kind == "worker_failed":
            raise _Retry(str(item), link, crashed=True)
        if item.kind == "overloaded" and side == PREFILL:
            raise _Retry(f"worker {link.request_endpoint}: {item.message}", busy=True)
        if item.kind == "draining":
            link.mark_draining()
        if item.kind in ("draining", "transfer_failed"):
            failed_decode = decode if side == DECODE or item.kind == "transfer_failed" else None
            raise _Retry(f"worker {link.request_endpoint}: {item.kind}: {item.message}", failed_decode)
        raise RequestRejectedError(item.kind, item.message)
