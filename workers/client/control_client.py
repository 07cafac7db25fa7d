"""The control plane's side of control commands: send one to a worker and wait for its ControlAck.

Synchronous (Celery tasks have no event loop). Each call uses its own DEALER, so no reply of an
earlier call can be mistaken for this one's. A command that times out is sent again with the same
command id: a worker that did act on it answers with the answer it gave then instead of acting twice.
"""

import time
import uuid

import msgspec
import zmq

from workers import curve
from workers.protocol.messages import ControlAck, ControlRequest, GenerateError, StatusRequest, WorkerOutbound


class ControlTimeoutError(Exception):
    """The worker did not answer any try: it is down, or too busy to read its socket."""


class ControlRejectedError(Exception):
    """The worker could not read the command (it answered with a GenerateError, e.g. a malformed
    command or one an older worker does not know)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def new_command_id() -> str:
    return uuid.uuid4().hex


def send_control(
    endpoint: str,
    request: ControlRequest,
    *,
    timeout_s: float = 2.0,
    retries: int = 3,
    key: curve.CurveKey | None = None,
) -> ControlAck:
    """Send `request` to the worker whose ROUTER is at `endpoint`; its answer.

    Tries `retries` times, waiting `timeout_s` for the answer each time. The answer may say ok=False
    (the worker understood and refused, e.g. an invalid TTL policy): check `ack.ok`. `key`: the
    cluster's CURVE key (workers.curve), for a worker on the network.
    """
    if retries < 1:
        raise ValueError(f"retries must be at least 1, got {retries}")
    payload = msgspec.msgpack.encode(request)
    decoder = msgspec.msgpack.Decoder(WorkerOutbound)
    with zmq.Context.instance().socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        curve.connect(dealer, endpoint, key)
        for _ in range(retries):
            deadline = time.monotonic() + timeout_s
            try:
                # A message queued for a worker that is not there yet stays queued, so tries may
                # deliver several copies once it comes up: harmless, the later ones get the first answer.
                dealer.send(payload)
            except zmq.Again:
                continue
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(left * 1000):
                try:
                    reply = decoder.decode(dealer.recv())
                except msgspec.DecodeError as error:
                    raise ControlRejectedError(
                        "invalid_reply", f"undecodable answer from {endpoint}: {error}"
                    ) from None
                if isinstance(reply, ControlAck) and reply.command_id == request.command_id:
                    return reply
                if isinstance(reply, GenerateError):
                    raise ControlRejectedError(reply.kind, reply.message)
    raise ControlTimeoutError(
        f"no answer to {type(request).__name__} {request.command_id} from {endpoint} "
        f"after {retries} tries of {timeout_s} s"
    )


def wait_for_state(
    endpoint: str, state: str, *, timeout_s: float, poll_interval_s: float = 0.5, key: curve.CurveKey | None = None
) -> ControlAck:
    """Ask the worker for its status until it reports `state` (e.g. "drained"); that answer.

    Raises ControlTimeoutError when `timeout_s` passes first, or when the worker stops answering.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ack = send_control(
            endpoint, StatusRequest(new_command_id()), timeout_s=max(min(left, 2.0), 0.1), retries=1, key=key
        )
        if ack.state == state:
            return ack
        if time.monotonic() + poll_interval_s > deadline:
            raise ControlTimeoutError(
                f"worker at {endpoint} is still {ack.state!r}, not {state!r}, after {timeout_s} s"
            )
        time.sleep(poll_interval_s)
