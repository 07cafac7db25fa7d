"""Request bodies: a size cap and a deadline that hold while the body is being read, and JSON parsing."""

import asyncio
import json
from collections.abc import Awaitable, Callable

from django.conf import settings
from django.http import HttpRequest

from controlplane.gateway.errors import GatewayError

GATEWAY_PATH_PREFIX = "/v1/"
# Set in the ASGI scope when the body was cut off ("too_large" or "timed_out"); Django's request
# keeps the scope.
CUT_OFF_SCOPE_KEY = "sluice.body_cut_off"
_END_OF_BODY = {"type": "http.request", "body": b"", "more_body": False}

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyLimitMiddleware:
    """ASGI middleware for the API paths. Django reads the whole body before a view runs, so the limits
    must apply while reading: a body over SLUICE_MAX_BODY_BYTES (declared by Content-Length, or counted
    as it arrives when there is none), or one still arriving SLUICE_BODY_READ_TIMEOUT_S after the
    request began (a slow client, or a Content-Length longer than what is sent), ends early for Django;
    the scope is marked so that the view answers 413 or 408 in its protocol's shape, and the rest of the
    body is never read. No engine work starts before the body is whole."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATEWAY_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        too_large = _declared_length(scope) > settings.SLUICE_MAX_BODY_BYTES
        scope = {**scope, CUT_OFF_SCOPE_KEY: "too_large" if too_large else None}
        capped = _CappedBody(scope, receive, send, settings.SLUICE_MAX_BODY_BYTES, settings.SLUICE_BODY_READ_TIMEOUT_S)
        await self.app(scope, capped.receive, capped.send)


class _CappedBody:
    def __init__(self, scope: dict, receive: Receive, send: Send, limit: int, timeout_s: float) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._limit = limit
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._received = 0
        self._ended = False  # the body ended for the app, whole or cut off
        self._responded = asyncio.Event()

    async def receive(self) -> dict:
        if self._scope[CUT_OFF_SCOPE_KEY]:
            if not self._ended:
                self._ended = True
                return _END_OF_BODY
            # Django listens for a disconnect after the body. Reading on would pull in the rest of
            # the body, so wait for the response instead; the server then drops the connection.
            await self._responded.wait()
            return {"type": "http.disconnect"}
        if self._ended:  # only a disconnect is left to come, whenever it does (a long stream)
            return await self._receive()
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            return self._cut_off("timed_out")
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                return self._cut_off("too_large")
            self._ended = not message.get("more_body", False)
        return message

    async def send(self, message: dict) -> None:
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._responded.set()

    def _cut_off(self, reason: str) -> dict:
        self._scope[CUT_OFF_SCOPE_KEY] = reason
        self._ended = True
        return _END_OF_BODY


def _declared_length(scope: dict) -> int:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def check_body_received(request: HttpRequest) -> None:
    """413 for a body over the limit, 408 for one that did not arrive in time."""
    limit = settings.SLUICE_MAX_BODY_BYTES
    declared = request.META.get("CONTENT_LENGTH") or "0"
    cut_off = getattr(request, "scope", {}).get(CUT_OFF_SCOPE_KEY)
    if cut_off == "too_large" or (declared.isdigit() and int(declared) > limit):
        raise GatewayError("request_too_large", f"The request body is larger than the limit of {limit} bytes.")
    if cut_off == "timed_out":
        raise GatewayError(
            "request_timeout",
            f"The request body did not arrive within {settings.SLUICE_BODY_READ_TIMEOUT_S:g} seconds.",
        )


def parse_json_body(raw: bytes) -> dict:
    """Bytes that are not UTF-8 become lone surrogates (surrogateescape), so that the recipe's bounds
    check refuses them naming the field they are in; JSON outside strings must be valid either way."""
    text = raw.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as error:
        raise GatewayError("invalid_request", f"The request body is not valid JSON: {error}") from error
    except RecursionError:
        # Python's parser recurses per level: a body nested near its stack's depth cannot be read at
        # all, let alone checked field by field (SLUICE_MAX_JSON_DEPTH refuses far shallower ones).
        raise GatewayError("invalid_request", "The request body nests arrays and objects too deep to read.") from None
    if not isinstance(body, dict):
        raise GatewayError("invalid_request", "The request body must be a JSON object.")
    return body


def _refuse_constant(name: str) -> None:
    # Python's json reads NaN and Infinity, which JSON does not have.
    raise ValueError(f"{name} is not a JSON value")
