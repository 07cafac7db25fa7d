"""Where an encode worker sends embeddings: one DEALER per destination (the request ROUTER of a
prefill or mixed worker), connected on first use as every other socket is (workers.curve), the least
recently used closed beyond MAX_DESTINATIONS. Sends never block the encoder: a destination whose
queue is full (a worker that stopped reading) makes that request fail, not the others."""

import logging
from collections import OrderedDict

import zmq

from workers import curve
from workers.protocol.errors import InvalidRequestError

log = logging.getLogger(__name__)

SCHEMES = ("tcp", "ipc")
# Workers one encoder sends to at once: a pool's prefill and mixed workers, with room to spare.
MAX_DESTINATIONS = 256
CLOSE_LINGER_MS = 500  # time for a closed destination's last deliveries to leave
# Messages (one per image) queued for one destination before its requests fail: a worker that takes
# no deliveries for this many images is not coming back soon.
SEND_QUEUE_MESSAGES = 1024


class Destinations:
    def __init__(self, context: zmq.Context, key: curve.CurveKey | None) -> None:
        self.context = context
        self.key = key
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()

    def check(self, endpoint: str) -> None:
        """InvalidRequestError naming `destination` for an endpoint this encoder cannot send to."""
        scheme, separator, _ = endpoint.partition("://")
        if not separator or scheme not in SCHEMES:
            raise InvalidRequestError(f"destination: {endpoint!r} is not a {' or '.join(SCHEMES)} endpoint")
        try:
            curve.uses_curve(endpoint, self.key)
        except curve.CurveError as error:
            raise InvalidRequestError(f"destination: {error}") from None
        self._socket(endpoint)

    def send(self, endpoint: str, frames: list[bytes]) -> bool:
        """Queue one multipart message for `endpoint` (checked before); False when its queue is full."""
        try:
            self._socket(endpoint).send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def discard_replies(self) -> None:
        """A destination answers deliveries it refused (a GenerateError for the request): the gateway
        hears of them from the worker too, so they are only logged here."""
        for endpoint, socket in self._sockets.items():
            while True:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                log.warning("destination %s answered a delivery: %r", endpoint, frames[0][:200])

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=CLOSE_LINGER_MS)
        self._sockets.clear()

    def _socket(self, endpoint: str) -> zmq.Socket:
        socket = self._sockets.get(endpoint)
        if socket is not None:
            self._sockets.move_to_end(endpoint)
            return socket
        socket = self.context.socket(zmq.DEALER)
        socket.sndhwm = SEND_QUEUE_MESSAGES
        try:
            curve.connect(socket, endpoint, self.key)
        except zmq.ZMQError as error:
            socket.close(linger=0)
            raise InvalidRequestError(f"destination: cannot connect to {endpoint!r}: {error}") from None
        self._sockets[endpoint] = socket
        if len(self._sockets) > MAX_DESTINATIONS:
            _, oldest = self._sockets.popitem(last=False)
            oldest.close(linger=CLOSE_LINGER_MS)
        return socket
