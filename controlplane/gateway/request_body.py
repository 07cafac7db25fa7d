"""Request bodies: a size cap that holds while the body is being read, and JSON parsing."""

import asyncio
import json
from collections.abc import Awaitable, Callable

from django.conf import settings
from django.http import HttpRequest

from controlplane.gateway.errors import GatewayError

GATEWAY_PATH_PREFIX = "/v1/"
# Set in the ASGI scope when a body was cut off at the cap; Django's request keeps the scope.
TOO_LARGE_SCOPE_KEY = "sluice.body_too_large"
_END_OF_BODY = {"type": "http.request", "body": b"", "more_body": False}

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyLimitMiddleware:
    """ASGI middleware for the API paths. Django reads the whole body before a view runs, so the cap
    must apply while reading: a body over SLUICE_MAX_BODY_BYTES (declared by Content-Length, or
    counted as it arrives when there is none) ends early for Django, the scope is marked so that the
    view answers 413 in its protocol's shape, and the rest of the body is never read."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATEWAY_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        scope = {**scope, TOO_LARGE_SCOPE_KEY: _declared_length(scope) > settings.SLUICE_MAX_BODY_BYTES}
        capped = _CappedBody(scope, receive, send, settings.SLUICE_MAX_BODY_BYTES)
        await self.app(scope, capped.receive, capped.send)


class _CappedBody:
    def __init__(self, scope: dict, receive: Receive, send: Send, limit: int) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._limit = limit
        self._received = 0
        self._ended = False
        self._responded = asyncio.Event()

    async def receive(self) -> dict:
        if self._scope[TOO_LARGE_SCOPE_KEY]:
            if not self._ended:
                self._ended = True
                return _END_OF_BODY
            # Django listens for a disconnect after the body. Reading on would pull in the rest of
            # the body, so wait for the response instead; the server then drops the connection.
            await self._responded.wait()
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                self._scope[TOO_LARGE_SCOPE_KEY] = True
                self._ended = True
                return _END_OF_BODY
        return message

    async def send(self, message: dict) -> None:
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._responded.set()


def _declared_length(scope: dict) -> int:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def check_body_size(request: HttpRequest) -> None:
    limit = settings.SLUICE_MAX_BODY_BYTES
    declared = request.META.get("CONTENT_LENGTH") or "0"
    cut_off = getattr(request, "scope", {}).get(TOO_LARGE_SCOPE_KEY, False)
    if cut_off or (declared.isdigit() and int(declared) > limit):
        raise GatewayError("request_too_large", f"The request body is larger than the limit of {limit} bytes.")


def parse_json_object(request: HttpRequest) -> dict:
    try:
        body = json.loads(request.body)
    except (ValueError, RecursionError) as error:  # ValueError covers bad JSON and bad UTF-8
        raise GatewayError("invalid_request", f"The request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise GatewayError("invalid_request", "The request body must be a JSON object.")
    return body
