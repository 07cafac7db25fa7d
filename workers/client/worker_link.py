"""A worker as the gateway's engine client sees it (its sockets, last heartbeat and the streams it
serves), the errors a stream ends with, and the choice of the least loaded worker: what the engine
client and the split streams it runs both build on."""

from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq.asyncio

from workers.protocol.messages import READY, GenerateError, GenerateOutput, WorkerHeartbeat


class WorkerUnavailableError(Exception):
    """No healthy worker can take the request, or the one serving it went away."""


class RequestRejectedError(Exception):
    """The worker refused or failed the request: kind is a GenerateError's ("invalid_request",
    "invalid_constraint", "overloaded", "internal", "worker_failed")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


# What a stream's queue carries: the worker's messages, or the reason the worker is gone.
StreamItem = GenerateOutput | GenerateError | WorkerUnavailableError


class StreamSink(Protocol):
    """Where a link puts a request's messages: its stream's queue, or a wrapper (split_stream)."""

    def put_nowait(self, item: StreamItem) -> None: ...


@dataclass(eq=False)
class WorkerLink:
    """One worker as this client sees it."""

    request_endpoint: str
    dealer: zmq.asyncio.Socket
    subscriber: zmq.asyncio.Socket
    heartbeat: WorkerHeartbeat | None = None
    heartbeat_received_at: float = float("-inf")  # time.monotonic() here, immune to clock skew
    streams: dict[str, StreamSink] = field(default_factory=dict)  # by request id
    # The decode requests this client placed here, and their reserved peak KV (entrypoint.router).
    num_decode_requests: int = 0
    reserved_kv_tokens: int = 0
    # Uncached prompt tokens of the prefills this client sent here that have not yet produced their
    # first token: the queue a new prefill waits behind (workers.client.prefill_deadlines).
    queued_prefill_tokens: int = 0
    # An encoder's: the vision-tower patches of the requests this client sent it that it has not yet
    # answered (done or failed), by request id (workers.client.encoders).
    encoding_patches: dict[str, int] = field(default_factory=dict)

    def is_healthy(self, now: float, timeout_s: float) -> bool:
        return self.heartbeat is not None and now - self.heartbeat_received_at <= timeout_s

    def is_ready(self, now: float, timeout_s: float) -> bool:
        return self.is_healthy(now, timeout_s) and self.heartbeat.state == READY

    @property
    def role(self) -> str:
        return self.heartbeat.role if self.heartbeat is not None else ""

    def mark_failed(self) -> None:
        """The worker reported that it failed as a whole: it is not healthy until it heartbeats again
        (restarted: its requests are gone, and its streams end)."""
        self.heartbeat_received_at = float("-inf")

    def mark_draining(self) -> None:
        """The worker refused a request as draining before its heartbeat said so: believe the refusal
        until its next heartbeat."""
        if self.heartbeat is not None:
            self.heartbeat = msgspec.structs.replace(self.heartbeat, state="draining")

    @property
    def load(self) -> int:
        # Requests this client has in flight there count at once; the heartbeat adds other
        # clients' requests but lags by up to an interval: the larger of the two is the estimate.
        reported = self.heartbeat.num_running + self.heartbeat.num_waiting if self.heartbeat else 0
        return max(len(self.streams), reported)

    def fail_streams(self, reason: str) -> None:
        for queue in self.streams.values():
            queue.put_nowait(WorkerUnavailableError(reason))
        self.streams.clear()
        self.encoding_patches.clear()


def least_loaded(links: list[WorkerLink]) -> WorkerLink:
    return min(links, key=lambda link: (link.load, link.heartbeat.kv_usage))
