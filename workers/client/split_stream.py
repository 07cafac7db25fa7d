"""A request's stream through its attempts, seen by the gateway as one stream: every request goes
through it. An attempt is split between a prefill and a decode worker while one of each is ready to
take it, and runs whole on one worker otherwise (mixed workers, or a pool that lost its other half).

A split attempt: the router picks the decode worker first (it must have room for the request's
KV), then the prefill worker. The decode worker is told to expect the request (so it knows where
its outputs go) before the prefill worker gets it with the decode worker's transfer endpoint. The
prefill worker's only output is the first token, with finish_reason "transfer", which the stream
passes on without it; the decode worker's outputs follow. The two come over different sockets, so a
decode output that overtakes the prefill's is held back until the prefill's has been passed on.

Deadlines (workers.client.prefill_deadlines) follow the request's predicted prefill time: the decode worker
waits for the KV as long as the prefill and the transfer are predicted to take, with margins, and
the stream waits that long for the decode worker's first output once the prefill's is out.

Moves. A draining decode worker, once its grace period is over, offers the request ("migrate"): it
moves, KV and decoding state, to another decode worker (_Path.migrate); when none has room for the
KV it holds now plus what it is expected to add, the offer is declined and the request decodes on
where it is (offered again a little later). A decode worker that goes away or fails once it has
streamed, a migration that fails, and a migration target that refuses the request (full or
draining, even after its KV was sent) are recovered from without a rerun: another decode worker
resumes the request from the checkpoint of the last one that streamed it and the KV store,
continuing after the tokens the client has (_Path.recover). A resume refused for its checkpoint
("checkpoint_invalid"), or with no decode worker left to take it, falls back to a rerun, as follows.

Failures. A worker that refuses as draining, a transfer that fails (the prefill worker could not
send, the decode worker could not assemble or admit it, or no decode output came within the
transfer deadline), and a worker that goes away (its heartbeats stop, or it reports it failed)
before the decode worker streamed end the attempt, and the request runs again from the start, on
other workers than those that failed it: split again, or whole on one worker when no other prefill
or decode worker is ready (with none at all, WorkerUnavailableError). Outputs the client already has
are skipped: the retry recomputes them and checks that it produced the same tokens, which a greedy
or seeded request always does. An unseeded sampled request that has already streamed tokens cannot
be continued that way (its seed, drawn by the engine, is in the checkpoint only): its stream fails
with WorkerUnavailableError, as do all after MAX_ATTEMPTS.

Crashes. A worker that went away, before or after the decode worker streamed, may have been brought
down by this very request: the request is a crash suspect (workers.client.crash_suspects), and so is a
request of which the same had been in flight on a failed worker before this stream began (a client
sending it again). A suspect is retried (rerun or resumed) once, and not at all when it was a
suspect from the start: a second crash, or the first of a request suspected from the start, fails it
"worker_failed" instead of taking the next worker down too. Wherever it goes, a suspect never runs
on the last worker able to serve requests (a ready one; a worker restarting is not one until its
heartbeats say it is ready): run whole, or resumed or moved to one decode worker, only while another
worker is ready besides. A split attempt always leaves one, since the decode worker computes nothing
of the request before the prefill worker is done with it. With no such place, the suspect fails
alone, "worker_failed", and the workers left serve the others. So with one prefill and one decode
worker, a request that crashes the prefill worker is not run whole on the decode worker; with two
mixed workers, one that crashes the first is not retried on the second; with three, it is retried on
one of the two left.

A worker that is full (overloaded) is back-pressure, not a failure: the request waits and tries again,
for up to CAPACITY_WAIT_S, before it is refused "overloaded". That holds for the decode worker too: the
decode balancer counts its requests from the gateway's side and its last heartbeat, so a request can
reach it while one that just finished still holds its place there.
Whatever ends a stream, each worker that may still hold the request is told to abort it, so both
sides free its KV.

Images. Each attempt of a request with images has them encoded for the worker that computes its
prompt (the prefill worker, or the one running it whole), sent with the request to that worker
(workers.client.encoders); a rerun elsewhere is a new destination, so it sends them again. An
encoder that fails is tried once more on another, across the request's attempts; then, or with no
encoder ready, the request fails "encode_failed" ("invalid_request" when the encoder refused the
images), without a rerun.
"""

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from workers.client.crash_suspects import CrashSuspects, leaves_another
from workers.client.encoders import ImageEncoding
from workers.client.prefill_deadlines import DeadlineModel
from workers.client.routing.prefix_match import StoreHit
from workers.client.routing.router import DecodeLoad, Router, expected_peak
from workers.client.store_hits import live_swa_endpoints, read_store_hit, swa_holders
from workers.client.worker_link import (
    RequestRejectedError,
    StreamItem,
    WorkerLink,
    WorkerUnavailableError,
    least_loaded,
)
from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.protocol.encode import EncodeImage, EncoderInbound
from workers.protocol.messages import (
    AbortRequest,
    DeclineMigrationRequest,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    MigrateRequest,
    ResumeDecodeRequest,
    WorkerHeartbeat,
    WorkerInbound,
)

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# Longest a request waits for a decode worker with room for its KV, or for a prefill worker to take
# it, before it is refused "overloaded": a burst the workers drain in tens of seconds (64 streams on
# two CPU cores) waits rather than failing part of its requests.
CAPACITY_WAIT_S = 30.0
CAPACITY_POLL_S = 0.05
PREFILL, DECODE = "prefill", "decode"
TRANSFER = "transfer"  # the phase between the prefill's last output and the decode's first
MIGRATE = "migrate"  # a draining decode worker's offer of the request (its last output there)
MOVING = "moving"  # the phase between a migration's offer and the new decode worker's first output
RESUMING = "resuming"  # the phase between a resume's request and its first output
# A migration or resume that produces no output in this long is given up: the migration is resumed
# by recompute instead, the resume rerun from the prompt. A resume fetches the stored blocks and
# recomputes at most the last one, behind whatever the worker is running.
MOVE_TIMEOUT_S = 30.0
# Migrations and resumes of one attempt; past this, the request is rerun.
MAX_RECOVERIES = 3
# Failures of the decode worker that a resume from its checkpoint recovers from; and refusals of a
# migration or resume that another decode worker may not give.
RECOVERABLE_KINDS = ("worker_failed", "transfer_failed")
MOVE_REFUSALS = ("overloaded", "draining")


class StreamClient(Protocol):
    """What a split stream uses of the engine client that runs it (workers.client.engine_client.EngineClient):
    its links, their sockets and its balancing state. Named here, so this module builds on the links
    alone and the client can import it."""

    crash_suspects: CrashSuspects
    closed: bool
    router: Router
    store_index: BlockIndex | None
    holders: HolderIndex | None
    deadline_model: DeadlineModel
    max_image_pixels: int | None

    def ready_links(self) -> list[WorkerLink]: ...

    def ready_encoders(self) -> list[WorkerLink]: ...

    def healthy_workers(self) -> list[WorkerHeartbeat]: ...

    def generate_whole(
        self, request: GenerateRequest, link: WorkerLink, encoding: ImageEncoding | None = None
    ) -> AsyncIterator[GenerateOutput]: ...

    async def send(self, link: WorkerLink, message: WorkerInbound | EncoderInbound) -> None: ...

    def send_now(self, link: WorkerLink, message: WorkerInbound | EncoderInbound) -> None: ...


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
    def __init__(self, client: StreamClient, request: GenerateRequest, images: tuple[EncodeImage, ...] = ()) -> None:
        self.client = client
        self.request = request
        self.images = images  # those request.images names, with their data
        self.failed_encoders: set[WorkerLink] = set()
        self.delivered: list[int] = []  # tokens the consumer has been given
        self.avoid: set[WorkerLink] = set()  # workers that failed this request
        self.num_split_attempts = 0
        self.crash = ""  # how a worker that held this request went away (empty: none did)
        # The same request was in flight on a worker that failed before this stream began.
        self.suspected_before = client.crash_suspects.suspected(request)

    @property
    def suspect(self) -> bool:
        """Whether the request may bring down the workers it runs on (workers.client.crash_suspects)."""
        return bool(self.crash) or self.suspected_before

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
                    # A token streamed from the prefill side of a request that cannot replay it ends it.
                    if time.monotonic() > busy_until or (self.delivered and not replayable):
                        raise RequestRejectedError("overloaded", str(retry)) from None
                    attempts -= 1
                    await asyncio.sleep(CAPACITY_POLL_S)
                    continue
                failure = retry
                if retry.crashed:
                    self.count_crash(str(retry))
                if retry.avoid is not None:
                    self.avoid.add(retry.avoid)
                if self.delivered and not replayable:
                    raise WorkerUnavailableError(
                        f"{retry}; request {self.request.request_id} had streamed {len(self.delivered)} "
                        "tokens and, sampled without a seed, cannot be continued elsewhere"
                    ) from None
                log.warning("retrying request %s: %s", self.request.request_id, retry)
        raise WorkerUnavailableError(f"request {self.request.request_id} failed {MAX_ATTEMPTS} times; last: {failure}")

    def count_crash(self, reason: str) -> None:
        """The request was in flight on a worker that went away: tried again once at most, and not
        at all when the same request was in flight on one that did before this stream began. (When
        the client itself closed, no worker failed: the stream just ends.)"""
        if self.client.closed:
            raise WorkerUnavailableError(reason) from None
        self.client.crash_suspects.record(self.request)
        if self.suspect:
            raise RequestRejectedError(
                "worker_failed",
                f"request {self.request.request_id} was in flight on engine workers that failed; "
                f"not retried again (last: {reason})",
            ) from None
        self.crash = reason

    async def _attempt(self) -> AsyncIterator[GenerateOutput]:
        chosen = await self._choose()
        if isinstance(chosen, WorkerLink):
            async for output in self._whole(chosen):
                yield output
            return
        async for output in self._split(*chosen):
            yield output

    async def _whole(self, link: WorkerLink) -> AsyncIterator[GenerateOutput]:
        request = self.request
        if link.heartbeat.swa_layers is not None:
            # A sliding-window model's worker learns where the state it may fetch is held.
            hit, live = await self._store_hit(link)
            request = msgspec.structs.replace(request, swa_holders=swa_holders(hit, live))
        try:
            async for output in self.client.generate_whole(request, link, self._encoding(request.request_id, link)):
                yield output
        except WorkerUnavailableError as error:
            raise _Retry(str(error), link, crashed=True) from None
        except RequestRejectedError as error:
            if error.kind == "worker_failed":
                raise _Retry(str(error), link, crashed=True) from None
            if error.kind != "draining":
                raise
            link.mark_draining()
            raise _Retry(f"worker {link.request_endpoint}: draining: {error.message}", link) from None

    def _encoding(self, request_id: str, destination: WorkerLink) -> ImageEncoding | None:
        """The encoding of the request's images for `destination`, under `request_id`; None without images."""
        if not self.images:
            return None
        return ImageEncoding(
            self.client, request_id, self.images, destination, self.failed_encoders, self.client.max_image_pixels
        )

    async def _choose(self) -> tuple[WorkerLink, WorkerLink, float, StoreHit, dict[str, str]] | WorkerLink:
        """(prefill, decode, the prefill compute charged to the router, the prompt's hit in the store
        and the live SWA state endpoints it was read against), or the one worker to run the request
        whole on when no prefill or no decode worker but those that failed this request is ready."""
        router, request = self.client.router, self.request
        deadline = time.monotonic() + CAPACITY_WAIT_S
        while True:
            ready = self.client.ready_links()
            prefills = [link for link in ready if link.role == PREFILL and link not in self.avoid]
            decodes = [link for link in ready if link.role == DECODE and link not in self.avoid]
            if not prefills or not decodes:
                return self._whole_worker(ready)
            by_key = {link.request_endpoint: link for link in decodes}
            kv_tokens, output = expected_peak(
                request, min(link.heartbeat.max_model_len for link in decodes), len(self.delivered)
            )
            loads = [
                DecodeLoad(link.request_endpoint, link.heartbeat, link.num_decode_requests, link.reserved_kv_tokens)
                for link in decodes
            ]
            key = router.choose_decode(loads, kv_tokens, output)
            if key is not None:
                break
            if time.monotonic() > deadline:
                raise RequestRejectedError(
                    "overloaded", f"no decode worker has room for {kv_tokens + output} tokens of KV"
                )
            await asyncio.sleep(CAPACITY_POLL_S)
        hit, live = await self._store_hit(prefills[0])
        holding = [link.request_endpoint for link in prefills if link.heartbeat.worker_id in hit.holders]
        prefill_key, cost = router.choose_prefill(
            [(link.request_endpoint, link.heartbeat) for link in prefills],
            len(request.prompt_token_ids),
            hit.compute_from,
            holding,
        )
        prefill = next(link for link in prefills if link.request_endpoint == prefill_key)
        return prefill, by_key[key], cost, hit, live

    def _whole_worker(self, ready: list[WorkerLink]) -> WorkerLink:
        """The least loaded of the ready workers that did not fail this request; for a suspect, only
        while another worker is ready besides."""
        usable = [link for link in ready if link not in self.avoid]
        if self.suspect:
            usable = [link for link in usable if leaves_another(ready, link)]
            if not usable:
                crash = f"({self.crash})" if self.crash else "before"
                raise RequestRejectedError(
                    "worker_failed",
                    f"request {self.request.request_id} was in flight on an engine worker that failed {crash}; "
                    f"not run again, as each of the {len(ready)} workers ready failed it or is the last one ready",
                )
        if not usable:
            raise WorkerUnavailableError(f"no healthy worker ready for request {self.request.request_id}")
        return least_loaded(usable)

    async def _store_hit(self, worker: WorkerLink) -> tuple[StoreHit, dict[str, str]]:
        """The prompt's hit in the global KV store as `worker` uses it (workers.client.store_hits), and
        the live SWA state endpoints it was read against."""
        live = live_swa_endpoints(self.client.healthy_workers())
        hit = await read_store_hit(self.client.store_index, self.client.holders, self.request, worker.heartbeat, live)
        return hit, live

    async def _split(
        self, prefill: WorkerLink, decode: WorkerLink, cost: float, hit: StoreHit, live: dict[str, str]
    ) -> AsyncIterator[GenerateOutput]:
        # Each attempt goes to the workers under an id of its own: the answer to an abort sent when an
        # earlier attempt ended (a decode worker replies to it) must not end this one.
        self.num_split_attempts += 1
        request_id = f"{self.request.request_id}#{self.num_split_attempts}"
        client, request = self.client, msgspec.structs.replace(self.request, request_id=request_id)
        prompt_tokens = len(request.prompt_token_ids)
        deadlines = client.deadline_model.deadlines(
            prompt_tokens=prompt_tokens,
            cached_tokens=hit.compute_from,
            queued_tokens=prefill.queued_prefill_tokens,
            prediction_error=prefill.heartbeat.cost_model_error_p90,
        )
        queued = max(prompt_tokens - hit.compute_from, 0)
        prefill.queued_prefill_tokens += queued
        queue: asyncio.Queue[tuple[str, StreamItem]] = asyncio.Queue()
        path = _Path(self, request, queue, deadlines.transfer_s)
        path.open(prefill, request_id, PREFILL)
        path.place_decode(decode, request_id)
        charged = True  # the prefill's predicted compute still counts against the prefill worker
        produced = 0  # tokens this attempt has streamed
        early: collections.deque[GenerateOutput] = collections.deque()  # decode outputs ahead of the prefill's
        encoding = self._encoding(request_id, prefill)
        try:
            await client.send(decode, ExpectTransferRequest(request_id, request.constraint, deadlines.handoff_s))
            routed = msgspec.structs.replace(
                request, decode_endpoint=decode.heartbeat.transfer_endpoint, swa_holders=swa_holders(hit, live)
            )
            if encoding is not None:
                await encoding.start()
            await client.send(prefill, routed)
            while True:
                if early and path.phase != PREFILL:
                    side, item = path.decode_side, early.popleft()
                else:
                    side, item = await path.next()
                if side not in (PREFILL, path.decode_side):
                    # From a decode worker the request moved away from: only its failing to send matters.
                    if side == path.moving_from_side and isinstance(item, WorkerUnavailableError | GenerateError):
                        reason = f"the migration from {path.moving_from.request_endpoint} failed: {item}"
                        await path.recover(reason, crashed=path.moving_from if _is_crash(item) else None)
                    continue
                if isinstance(item, WorkerUnavailableError | GenerateError):
                    if side != PREFILL and produced == len(self.delivered) and path.can_recover(item):
                        await path.recover(str(item), crashed=path.decode if _is_crash(item) else None)
                        continue
                    path.release(side)
                    self._fail(PREFILL if side == PREFILL else DECODE, item, prefill, path.decode)
                if side != PREFILL and path.phase == PREFILL:
                    early.append(item)
                    continue
                if side == PREFILL:
                    if encoding is not None:  # the prefill computed the prompt: its images arrived
                        encoding.stop()
                    if charged:
                        client.router.prefill_done(prefill.request_endpoint, cost)
                        prefill.queued_prefill_tokens -= queued
                        charged = False
                    if item.finish_reason == TRANSFER:
                        path.phase = TRANSFER  # the prefill worker may still be sending: it stays held
                        item = msgspec.structs.replace(item, finish_reason=None)
                elif item.finish_reason == MIGRATE:
                    await path.migrate()
                    if not item.text:
                        continue
                    item = msgspec.structs.replace(item, finish_reason=None)
                elif path.phase != DECODE:
                    # The decode worker's first output: the prefill worker's part, or a move, is over.
                    path.phase = DECODE
                    path.settle()
                if item.finish_reason is not None:
                    path.release(side)
                produced += len(item.token_ids)
                yield msgspec.structs.replace(item, request_id=self.request.request_id)
                if item.finish_reason is not None:
                    return
        finally:
            if encoding is not None:
                encoding.stop()
            if charged:
                client.router.prefill_done(prefill.request_endpoint, cost)
                prefill.queued_prefill_tokens -= queued
            path.close()

    def _fail(
        self, side: str, item: WorkerUnavailableError | GenerateError, prefill: WorkerLink, decode: WorkerLink
    ) -> None:
        """Raise what a worker's error or disappearance means for the attempt."""
        link = prefill if side == PREFILL else decode
        if _is_crash(item):
            raise _Retry(str(item), link, crashed=True)
        if item.kind == "overloaded":
            raise _Retry(f"{side} worker {link.request_endpoint}: {item.message}", busy=True)
        if item.kind == "checkpoint_invalid":
            raise _Retry(f"worker {link.request_endpoint}: {item.message}; rerunning from the prompt")
        if item.kind == "draining":
            link.mark_draining()
        if item.kind in ("draining", "transfer_failed"):
            failed_decode = decode if side == DECODE or item.kind == "transfer_failed" else None
            raise _Retry(f"worker {link.request_endpoint}: {item.kind}: {item.message}", failed_decode)
        raise RequestRejectedError(item.kind, item.message)


class _Path:
    """The workers one attempt of a split request is on, and how it moves between decode workers.

    It starts on a prefill worker and a decode worker. A draining decode worker's offer ("migrate")
    moves it to another decode worker chosen by the decode balancer, which takes its KV and decoding
    state from the draining one (MOVING); a decode worker that dies or fails mid-stream, or a
    migration that fails, is recovered from by resuming the request on another decode worker from
    the failed one's checkpoint and the KV store (RESUMING), with the tokens the client already has.
    Each worker gets the request under an id of its own, and its outputs come tagged with a side
    of its own ("prefill", "decode0", "decode1", ...), so late messages from a worker the request
    left are told apart. It tracks which workers may still hold the request (aborted at the end)
    and the decode load this client charged to the current decode worker.
    """

    def __init__(
        self, stream: "SplitStream", request: GenerateRequest, queue: asyncio.Queue, transfer_s: float
    ) -> None:
        self.stream = stream
        self.client = stream.client
        self.request = request  # under the attempt's id
        self.queue = queue
        self.transfer_s = transfer_s
        self.phase = PREFILL
        self.sinks: list[tuple[WorkerLink, str, _Tagged]] = []
        self.holding: dict[WorkerLink, str] = {}  # workers that may still hold the request → its id there
        self.decode: WorkerLink | None = None
        self.decode_id = self.decode_side = ""
        self.moving_from: WorkerLink | None = None
        self.moving_from_id = self.moving_from_side = ""
        # The id the request was last checkpointed under: by the decode worker that last streamed it.
        self.checkpoint_id = ""
        self.prefill_side_open = True
        self.num_decodes = 0
        self.num_recoveries = 0
        self.peak = 0

    def open(self, link: WorkerLink, request_id: str, side: str) -> None:
        sink = _Tagged(self.queue, side)
        link.streams[request_id] = sink
        self.sinks.append((link, request_id, sink))
        self.holding[link] = request_id

    def place_decode(self, link: WorkerLink, request_id: str) -> None:
        """Make `link` the decode worker, charging it the request's peak KV (and uncharging the last)."""
        self._uncharge()
        self.decode, self.decode_id, self.decode_side = link, request_id, f"{DECODE}{self.num_decodes}"
        self.num_decodes += 1
        self.open(link, request_id, self.decode_side)
        self.peak = sum(expected_peak(self.request, link.heartbeat.max_model_len, len(self.stream.delivered)))
        link.num_decode_requests += 1
        link.reserved_kv_tokens += self.peak

    async def next(self) -> tuple[str, StreamItem]:
        while True:
            if self.phase in (PREFILL, DECODE):
                return await self.queue.get()
            wait_s = self.transfer_s if self.phase == TRANSFER else MOVE_TIMEOUT_S
            try:
                return await asyncio.wait_for(self.queue.get(), wait_s)
            except TimeoutError:
                reason = f"decode worker {self.decode.request_endpoint} sent nothing for {wait_s:g} s"
                if self.phase != MOVING:
                    raise _Retry(reason) from None
                await self.recover(reason, crashed=None)

    def can_recover(self, item: WorkerUnavailableError | GenerateError) -> bool:
        """Whether the current decode worker's failure is one a resume recovers from."""
        if isinstance(item, WorkerUnavailableError) or item.kind in RECOVERABLE_KINDS:
            return self.phase in (DECODE, MOVING, RESUMING)
        return self.phase in (MOVING, RESUMING) and item.kind in MOVE_REFUSALS

    async def migrate(self) -> None:
        """The decode worker offers the request: move it, KV and all, to another decode worker, or,
        when none has room, decline the offer so that it decodes on where it is."""
        source = self.decode
        source.mark_draining()
        target = self._choose_decode(exclude={source})
        if target is None:
            log.info(
                "request %s stays on draining %s: no other decode worker has room",
                self.request.request_id,
                source.request_endpoint,
            )
            await self.client.send(source, DeclineMigrationRequest(self.decode_id))
            return
        self.moving_from, self.moving_from_id, self.moving_from_side = source, self.decode_id, self.decode_side
        new_id = self._new_id()
        self.place_decode(target, new_id)
        self.phase = MOVING
        await self.client.send(target, ExpectTransferRequest(new_id, self.request.constraint, MOVE_TIMEOUT_S))
        await self.client.send(source, MigrateRequest(self.moving_from_id, new_id, target.heartbeat.transfer_endpoint))

    async def recover(self, reason: str, *, crashed: WorkerLink | None) -> None:
        """Resume the request on another decode worker from the checkpoint of the one that had it;
        `crashed`: the worker that went away with the request, which makes it a crash suspect."""
        self.num_recoveries += 1
        failed = [link for link in (self.decode, self.moving_from) if link is not None]
        if crashed is not None:
            self.stream.count_crash(reason)
            self.stream.avoid.add(crashed)
        if self.num_recoveries > MAX_RECOVERIES:
            raise _Retry(f"{reason} (after {MAX_RECOVERIES} migrations and resumes)", self.decode)
        target = self._choose_decode(exclude=set(failed))
        if target is None:
            raise _Retry(f"{reason}; no other decode worker can resume it", self.decode)
        log.warning("resuming request %s on %s: %s", self.request.request_id, target.request_endpoint, reason)
        for link in failed:
            self._drop(link)
        self.moving_from = None
        new_id = self._new_id()
        self.place_decode(target, new_id)
        self.phase = RESUMING
        resumed = msgspec.structs.replace(self.request, request_id=new_id)
        await self.client.send(target, ResumeDecodeRequest(resumed, list(self.stream.delivered), self.checkpoint_id))

    def settle(self) -> None:
        """The current decode worker sent its first output: it has checkpointed the request, and the
        worker before it is done with it."""
        self.checkpoint_id = self.decode_id
        if self.prefill_side_open:
            self.prefill_side_open = False
            prefill = next(link for link, _, sink in self.sinks if sink.side == PREFILL)
            self._drop(prefill, abort=False)
        if self.moving_from is not None:
            self._drop(self.moving_from, abort=False)
            self.moving_from = None

    def release(self, side: str) -> None:
        """The worker on `side` has ended the request (it finished or failed there)."""
        for link, _, sink in self.sinks:
            if sink.side == side:
                self.holding.pop(link, None)

    def close(self) -> None:
        for link, request_id, sink in self.sinks:
            if link.streams.get(request_id) is sink:
                del link.streams[request_id]
        for link, request_id in self.holding.items():
            self.client.send_now(link, AbortRequest(request_id))
        self._uncharge()

    def _drop(self, link: WorkerLink, *, abort: bool = True) -> None:
        request_id = self.holding.pop(link, None)
        if abort and request_id is not None:
            self.client.send_now(link, AbortRequest(request_id))
        for other, other_id, sink in self.sinks:
            if other is link and other.streams.get(other_id) is sink:
                del other.streams[other_id]

    def _uncharge(self) -> None:
        if self.decode is not None:
            self.decode.num_decode_requests -= 1
            self.decode.reserved_kv_tokens -= self.peak

    def _new_id(self) -> str:
        return f"{self.request.request_id}.{self.num_decodes}"

    def _choose_decode(self, exclude: set[WorkerLink]) -> WorkerLink | None:
        """The decode worker the balancer picks among the ready ones left, or None; for a suspect,
        None when it would be the last worker able to serve requests."""
        every_ready = self.client.ready_links()
        ready = [
            link
            for link in every_ready
            if link.role == DECODE and link not in exclude and link not in self.stream.avoid
        ]
        if self.stream.suspect:
            ready = [link for link in ready if leaves_another(every_ready, link)]
        if not ready:
            return None
        kv_tokens, output = expected_peak(
            self.request, min(link.heartbeat.max_model_len for link in ready), len(self.stream.delivered)
        )
        loads = [
            DecodeLoad(link.request_endpoint, link.heartbeat, link.num_decode_requests, link.reserved_kv_tokens)
            for link in ready
        ]
        key = self.client.router.choose_decode(loads, kv_tokens, output)
        return next((link for link in ready if link.request_endpoint == key), None)


def _is_crash(item: WorkerUnavailableError | GenerateError) -> bool:
    """Whether a worker's error means it went away as a whole (it may have been this request)."""
    return isinstance(item, WorkerUnavailableError) or item.kind == "worker_failed"
