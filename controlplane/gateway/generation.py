"""One API call's generation: its n choices run as n engine requests consumed concurrently, and
every output goes through the recipe's ResponseBuilder, which turns it into protocol events.

A constraint goes to the workers with the grammar limits of this gateway's settings. A worker that
refuses it, or whose grammar fails on the output mid-way ("invalid_constraint"), ends the generation
with an invalid-request error naming the field the constraint came from: the HTTP error before the
first event, an error event after it.

Each choice's outputs are buffered for the client up to SLUICE_STREAM_BUFFER_OUTPUTS: a client that
stops reading a stream stops taking events, and once that many outputs wait for it the generation's
engine requests are aborted, so it holds no engine capacity and no more memory (it ends with an
error event, should the client read again). The call's hold on its tenant's caps counts each
choice's prompt as queued until its first output, and the call in flight until the generation ends.

A prompt with images names them in its GenerateRequest (content hash and placeholder count, in prompt
order), and the client gets the images themselves, which it sends to an encode worker.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import msgspec
from django.conf import settings

from controlplane.gateway.errors import GatewayError, as_gateway_error, error_event
from controlplane.gateway.tenant_caps import TenantHold
from controlplane.gateway.usage import UsageCount
from recipe.api import PreparedRequest, SseEvent
from recipe.constraint_fields import constraint_field
from workers.client.engine_client import EngineClient
from workers.client.worker_link import RequestRejectedError
from workers.protocol.images import ImageRef
from workers.protocol.messages import GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)

RESPONSE_ID_PREFIXES = {
    "chat.completions": "chatcmpl-",
    "completions": "cmpl-",
    "responses": "resp_",
    "messages": "msg_",
}
# What a choice's pump queues when the engine's stream of outputs ends.
_ENDED = None


def encode_sse(event: SseEvent) -> bytes:
    """One frame: `event:` only when named, and one `data:` line per line of data (SSE has no escaping)."""
    lines = [f"event: {event.event}\n"] if event.event else []
    lines += [f"data: {line}\n" for line in event.data.split("\n")]
    return ("".join(lines) + "\n").encode()


class Generation:
    def __init__(
        self,
        client: EngineClient,
        prepared: PreparedRequest,
        *,
        protocol: str,
        cache_namespace: str,
        hold: TenantHold,
        tenant: str,
        tenant_weight: int,
        on_end: Callable[[UsageCount], Awaitable[None]] | None = None,
    ) -> None:
        """on_end gets the tokens used and the outputs' timing once the generation ends, however it
        ends; then `hold` is released. `tenant` and `tenant_weight` place its requests in the engines'
        waiting queues."""
        self._client = client
        self._protocol = protocol
        self._on_end = on_end
        self._hold = hold
        self._max_buffered = settings.SLUICE_STREAM_BUFFER_OUTPUTS
        self._pumps: list[asyncio.Task] = []
        self._usage = UsageCount()
        response_id = f"{RESPONSE_ID_PREFIXES[protocol]}{uuid.uuid4().hex}"
        self._builder = prepared.new_response(response_id, int(time.time()))
        self._images = prepared.images
        self._constraint = (
            msgspec.structs.replace(prepared.constraint, limits=settings.SLUICE_GRAMMAR_LIMITS)
            if prepared.constraint is not None
            else None
        )
        self._requests = [
            GenerateRequest(
                request_id=f"{response_id}-{choice}",
                prompt_token_ids=prepared.prompt_token_ids,
                params=prepared.sampling_params(choice),
                cache_namespace=cache_namespace,
                constraint=self._constraint,
                prompt_logprobs=prepared.prompt_logprobs,
                traffic_class=prepared.traffic_class,
                tenant=tenant,
                tenant_weight=tenant_weight,
                cache_hints=prepared.cache_hints,
                images=tuple(ImageRef(image.content_hash, image.num_tokens) for image in prepared.images),
            )
            for choice in range(prepared.n)
        ]
        self._events = self._run()
        self._first: SseEvent | None = None

    async def body(self) -> dict:
        """The whole response; raises what the engine raised."""
        async for _ in self._events:
            pass
        return self._builder.body()

    async def start_stream(self) -> None:
        """Waits for the first event, so that an engine that is down or rejects the request still gets
        an HTTP error status rather than a stream that breaks off; raises what the engine raised."""
        try:
            self._first = await anext(self._events, None)
        except BaseException:
            await self._events.aclose()
            raise

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE frames after start_stream(); a later failure ends the stream with an error event."""
        try:
            if self._first is not None:
                yield encode_sse(self._first)
            async for event in self._events:
                yield encode_sse(event)
        except Exception as error:
            yield encode_sse(error_event(self._protocol, as_gateway_error(error)))
        finally:
            await self._events.aclose()

    async def _run(self) -> AsyncIterator[SseEvent]:
        outputs: asyncio.Queue[tuple[int, GenerateOutput | Exception | None]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(choice, outputs)) for choice in range(len(self._requests))]
        running = set(range(len(self._requests)))
        try:
            while running:
                choice, output = await outputs.get()
                if isinstance(output, Exception):
                    raise self._constraint_error(output) or output
                if output is _ENDED:
                    if choice in running:
                        raise RuntimeError(f"engine stream of {self._requests[choice].request_id} ended unfinished")
                    continue
                self._usage.add(output, choice=choice)
                if output.finish_reason is not None:
                    running.discard(choice)
                for event in self._builder.push(choice, output):
                    yield event
            for event in self._builder.finish():
                yield event
        finally:
            # Reached on success, on an engine error, and when the client went away (the request
            # task is cancelled, or this generator is closed). Cancelling a pump closes its
            # `generate` stream, and the engine client aborts every request whose stream is closed
            # before its final output: the engine stops each choice still running.
            try:
                for pump in self._pumps:
                    pump.cancel()
                await asyncio.gather(*self._pumps, return_exceptions=True)
                if self._on_end is not None:
                    await self._on_end(self._usage)
            finally:
                # Even when the request task is cancelled while the pumps wind down.
                self._hold.release()

    def _constraint_error(self, error: Exception) -> GatewayError | None:
        """A worker's verdict on the request's constraint, as the client's error about its field."""
        refused = isinstance(error, RequestRejectedError) and error.kind == "invalid_constraint"
        if not refused or self._constraint is None:
            return None
        return GatewayError("invalid_request", error.message, param=constraint_field(self._protocol, self._constraint))

    async def _pump(self, choice: int, outputs: asyncio.Queue) -> None:
        first_seen = False
        try:
            request = self._requests[choice]
            async with aclosing(self._client.generate(request, images=self._images)) as stream:
                async for output in stream:
                    if not first_seen:
                        first_seen = True
                        self._hold.prompt_started(len(request.prompt_token_ids))
                    if outputs.qsize() >= self._max_buffered:
                        raise self._stop_unread()
                    outputs.put_nowait((choice, output))
            outputs.put_nowait((choice, _ENDED))
        except Exception as error:
            outputs.put_nowait((choice, error))

    def _stop_unread(self) -> GatewayError:
        """The client has not taken the outputs buffered for it: stop every choice. The calling pump
        closes its own stream as the error leaves it; closing a stream aborts its engine request."""
        log.warning("%s: the client stopped reading; aborting it", self._requests[0].request_id.rsplit("-", 1)[0])
        current = asyncio.current_task()
        for pump in self._pumps:
            if pump is not current:
                pump.cancel()
        return GatewayError(
            "request_timeout",
            f"The stream was stopped: the client left {self._max_buffered} outputs unread.",
        )
