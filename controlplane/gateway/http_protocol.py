"""The gateway's HTTP/1.1 for uvicorn (`serve` passes `--http` this class): h11's, with a deadline on
each request head, and a request that is not HTTP answered with a JSON error rather than text.

uvicorn arms no timer while a connection waits for its first request, and any byte that arrives
cancels its keep-alive timer, so a client that opens connections and sends nothing, or sends headers
a byte at a time, would hold each connection (and its file descriptor) for ever. Here a connection
that has not sent a whole request head SLUICE_HEADER_READ_TIMEOUT_S after it opened, or after its
previous response, is closed. Once the head is in, BodyLimitMiddleware bounds the body's time.
"""

import asyncio
import json

import h11
from django.conf import settings
from uvicorn.protocols.http.h11_impl import H11Protocol

from controlplane.gateway.errors import GatewayError, error_payload


class HeadDeadlineH11Protocol(H11Protocol):
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(settings.SLUICE_HEADER_READ_TIMEOUT_S, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        # A request being served (its head came in time) is the body deadline's and the app's business.
        waiting_for_a_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_a_head and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # What uvicorn answers when h11 cannot parse a request (bad framing, an unfinished head past
        # 16 KiB). The path, and with it the protocol, may be unknown: OpenAI's shape, which most
        # clients read.
        status, payload = error_payload("unknown", GatewayError("invalid_request", msg))
        body = json.dumps(payload).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
