"""Every error the gateway returns, in the shape of the protocol the client speaks.

Views raise (or let escape) exceptions; this module alone turns them into status codes and bodies:
OpenAI's `{"error": {"message", "type", "param", "code"}}` for the OpenAI endpoints and Anthropic's
`{"type": "error", "error": {"type", "message"}}` for /v1/messages*.
"""

import json
import logging
from dataclasses import dataclass
from typing import Literal

from django.http import JsonResponse

from recipe.api import ApiError, SseEvent
from workers.client.worker_link import RequestRejectedError, WorkerUnavailableError

log = logging.getLogger(__name__)

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "not_found",
    "unknown_path",
    "method_not_allowed",
    "request_timeout",
    "request_too_large",
    "rate_limit",
    "overloaded",
    "server_error",
]
# The protocols whose clients expect Anthropic's error shape; every other one gets OpenAI's.
ANTHROPIC_PROTOCOLS = frozenset({"messages", "messages.count_tokens"})
GENERIC_SERVER_ERROR = "The server had an error while processing your request."


class GatewayError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
        allow: tuple[str, ...] | None = None,  # the methods a 405's path takes
    ):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.allow = allow


@dataclass(frozen=True, slots=True)
class _Shape:
    openai_status: int
    openai_type: str
    openai_code: str | None
    anthropic_status: int
    anthropic_type: str


_SHAPES: dict[ErrorKind, _Shape] = {
    "invalid_request": _Shape(400, "invalid_request_error", None, 400, "invalid_request_error"),
    "authentication": _Shape(401, "authentication_error", "invalid_api_key", 401, "authentication_error"),
    "not_found": _Shape(404, "not_found_error", "model_not_found", 404, "not_found_error"),
    # What OpenAI answers for a path or method it does not serve.
    "unknown_path": _Shape(404, "invalid_request_error", None, 404, "not_found_error"),
    "method_not_allowed": _Shape(405, "invalid_request_error", None, 405, "invalid_request_error"),
    "request_timeout": _Shape(408, "invalid_request_error", None, 408, "invalid_request_error"),
    "request_too_large": _Shape(413, "invalid_request_error", None, 413, "request_too_large"),
    "rate_limit": _Shape(429, "rate_limit_exceeded", None, 429, "rate_limit_error"),
    "overloaded": _Shape(503, "overloaded_error", None, 529, "overloaded_error"),
    "server_error": _Shape(500, "server_error", None, 500, "api_error"),
}
_KIND_BY_API_STATUS: dict[int, ErrorKind] = {
    400: "invalid_request",
    401: "authentication",
    404: "not_found",
    413: "request_too_large",
    429: "rate_limit",
    503: "overloaded",
}


def as_gateway_error(error: Exception) -> GatewayError:
    """Anything raised while serving a request, as what the client may be told about it."""
    if isinstance(error, GatewayError):
        return error
    if isinstance(error, ApiError):
        kind = _KIND_BY_API_STATUS.get(error.status, "invalid_request" if error.status < 500 else "server_error")
        return GatewayError(kind, error.message, param=error.param)
    if isinstance(error, WorkerUnavailableError):
        return GatewayError("overloaded", "No engine worker is available; try again shortly.")
    if isinstance(error, RequestRejectedError) and error.kind == "overloaded":
        return GatewayError("overloaded", "The engine is overloaded; try again shortly.")
    if isinstance(error, RequestRejectedError) and error.kind == "invalid_request":
        return GatewayError("invalid_request", error.message)
    if isinstance(error, RequestRejectedError) and error.kind == "encode_failed":
        # No encoder could encode the request's images (none ready, or two failed): the images
        # passed the gateway's checks, so a retry may well succeed.
        return GatewayError("overloaded", f"The request's images could not be encoded: {error.message}")
    # Details of internal failures stay in the log, not in the response.
    log.error("request failed", exc_info=error)
    return GatewayError("server_error", GENERIC_SERVER_ERROR)


def unknown_path_protocol(path: str, anthropic_version: str | None) -> str:
    """The protocol whose error shape suits a request for a path no endpoint serves: Anthropic's under
    /v1/messages and for Anthropic's SDKs (which send `anthropic-version`), OpenAI's otherwise."""
    return "messages" if path.startswith("/v1/messages") or anthropic_version else "unknown"


def error_payload(protocol: str, error: GatewayError) -> tuple[int, dict]:
    """The status and body of `error` for a client of `protocol`."""
    shape = _SHAPES[error.kind]
    if protocol in ANTHROPIC_PROTOCOLS:
        return shape.anthropic_status, {
            "type": "error",
            "error": {"type": shape.anthropic_type, "message": error.message},
        }
    detail = {"message": error.message, "type": shape.openai_type, "param": error.param, "code": shape.openai_code}
    return shape.openai_status, {"error": detail}


def error_response(protocol: str, error: GatewayError) -> JsonResponse:
    status, payload = error_payload(protocol, error)
    response = JsonResponse(payload, status=status)
    if error.retry_after is not None:
        response["retry-after"] = str(error.retry_after)
    if error.allow is not None:
        response["allow"] = ", ".join(error.allow)
    return response


def error_event(protocol: str, error: GatewayError) -> SseEvent:
    """The same error as a stream event, for failures after the response has started."""
    _, payload = error_payload(protocol, error)
    return SseEvent(event="error" if protocol in ANTHROPIC_PROTOCOLS else None, data=json.dumps(payload))
