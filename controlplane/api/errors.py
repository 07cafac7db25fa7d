"""One error body for every /api/v1 error: {"error": {"type", "message", "fields"?}}."""

import logging

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView, set_rollback
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.common.errors import ConflictError, DomainValidationError

log = logging.getLogger(__name__)

ERROR_TYPES = [
    "validation_error",
    "authentication_error",
    "permission_denied",
    "not_found",
    "method_not_allowed",
    "conflict",
    "throttled",
    "parse_error",
    "server_error",
]

_TYPE_BY_STATUS = {
    status.HTTP_400_BAD_REQUEST: "validation_error",
    status.HTTP_401_UNAUTHORIZED: "authentication_error",
    status.HTTP_403_FORBIDDEN: "permission_denied",
    status.HTTP_404_NOT_FOUND: "not_found",
    status.HTTP_405_METHOD_NOT_ALLOWED: "method_not_allowed",
    # 406 and 415: the request's media types, a parse problem from the client's side.
    status.HTTP_406_NOT_ACCEPTABLE: "parse_error",
    status.HTTP_409_CONFLICT: "conflict",
    status.HTTP_415_UNSUPPORTED_MEDIA_TYPE: "parse_error",
    status.HTTP_429_TOO_MANY_REQUESTS: "throttled",
}


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The current state does not allow this."
    default_code = "conflict"


def error_body(error_type: str, message: str, fields: dict[str, list[str]] | None = None) -> dict:
    error = {"type": error_type, "message": message}
    if fields is not None:
        error["fields"] = fields
    return {"error": error}


def _flatten(detail, path: str = "") -> dict[str, list[str]]:
    """DRF's nested error detail as {"field.sub.0": [messages]}; non-field errors keep their key."""
    if isinstance(detail, dict):
        flat: dict[str, list[str]] = {}
        for key, value in detail.items():
            flat.update(_flatten(value, f"{path}.{key}" if path else str(key)))
        return flat
    if isinstance(detail, list) and any(isinstance(item, dict | list) for item in detail):
        flat = {}
        for index, item in enumerate(detail):
            flat.update(_flatten(item, f"{path}.{index}" if path else str(index)))
        return flat
    messages = [str(item) for item in detail] if isinstance(detail, list) else [str(detail)]
    return {path or api_settings.NON_FIELD_ERRORS_KEY: messages} if messages else {}


def _validation_body(detail) -> dict:
    fields = _flatten(detail)
    non_field = fields.pop(api_settings.NON_FIELD_ERRORS_KEY, [])
    return error_body("validation_error", " ".join(non_field) or "Invalid input.", fields)


def _as_api_exception(exc: Exception) -> Exception:
    """Django's and the services' errors as the DRF exceptions that carry their status code."""
    if isinstance(exc, ConflictError):
        return Conflict(str(exc) or None)
    if isinstance(exc, Http404):
        return exceptions.NotFound()
    if isinstance(exc, DjangoPermissionDenied):
        return exceptions.PermissionDenied()
    return exc


def exception_handler(exc: Exception, context: dict) -> Response:
    if isinstance(exc, DomainValidationError):
        set_rollback()
        fields = {name: [str(message) for message in messages] for name, messages in exc.fields.items()}
        return Response(error_body("validation_error", exc.message or "Invalid input.", fields), status=400)
    exc = _as_api_exception(exc)
    response = drf_exception_handler(exc, context)  # sets WWW-Authenticate, Allow, Retry-After; rolls back
    if response is None:
        log.error("unhandled error in %s", type(context.get("view")).__name__, exc_info=exc)
        set_rollback()
        return Response(error_body("server_error", "Internal server error."), status=500)
    if isinstance(exc, exceptions.ValidationError):
        response.data = _validation_body(exc.detail)
    else:
        # A bare APIException is a 500; every 4xx DRF raises is in the table.
        error_type = _TYPE_BY_STATUS.get(response.status_code, "server_error")
        if isinstance(exc, exceptions.ParseError):
            error_type = "parse_error"
        response.data = error_body(error_type, str(exc.detail))
    return response


class UnknownPathView(APIView):
    """Any path under /api/v1/ that no route matches: a 404 in the error shape above, whatever the method."""

    authentication_classes = []
    permission_classes = []
    schema = None

    def initial(self, request, *args, **kwargs):
        raise exceptions.NotFound(f"No endpoint at {request.path}.")
