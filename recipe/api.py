"""The one entry point the gateway uses: API request bodies → engine inputs, engine outputs → API
responses and stream events, for OpenAI Chat Completions, Completions and Responses and Anthropic
Messages.

    prepared = prepare_request("chat.completions", body, models)     # raises ApiError
    builder = prepared.new_response(response_id, created)
    for each engine output of choice i: events = builder.push(i, output)
    events = builder.finish()   # streams;   body = builder.body()   # non-stream
"""

from collections.abc import Mapping
from typing import get_args

from recipe.completions import prepare_completion
from recipe.conversation_requests import count_prompt_tokens, prepare_conversation_request
from recipe.errors import ApiError, invalid_request
from recipe.images.resolve import RequestImage
from recipe.limits import RequestLimits, check_request_bounds
from recipe.prepared_request import ApiProtocol, PreparedRequest, ResponseBuilder, SseEvent
from recipe.served_model import ServedModel

Protocol = ApiProtocol
OWNED_BY = "sluice"

__all__ = [
    "ApiError",
    "PreparedRequest",
    "Protocol",
    "RequestImage",
    "RequestLimits",
    "ResponseBuilder",
    "ServedModel",
    "SseEvent",
    "count_tokens",
    "list_models",
    "prepare_request",
]


def prepare_request(
    protocol: Protocol,
    body: dict,
    models: Mapping[str, ServedModel],
    limits: RequestLimits = RequestLimits(),
    images: tuple[RequestImage, ...] | None = None,
) -> PreparedRequest:
    """Raises ApiError: 400 for a malformed or invalid request or one past `limits` (with the field in
    `param`), 404 for an unknown model, 400 when the prompt plus max_tokens does not fit the context
    window. `images`: the body's images as read already, by an earlier preparation of the same body
    (its PreparedRequest.read_images); None: they are read here."""
    if protocol not in get_args(Protocol):
        raise ValueError(f"unknown protocol {protocol!r}")
    model = _served_model(body, models, protocol, limits)
    if protocol == "completions":
        return prepare_completion(body, model, limits)
    return prepare_conversation_request(protocol, body, model, limits, images)


def count_tokens(body: dict, models: Mapping[str, ServedModel], limits: RequestLimits = RequestLimits()) -> int:
    """Anthropic's /v1/messages/count_tokens: the prompt length of this Messages request."""
    return count_prompt_tokens("messages", body, _served_model(body, models, "messages.count_tokens", limits), limits)


def list_models(models: Mapping[str, ServedModel], created: int) -> dict:
    """OpenAI's /v1/models body."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": OWNED_BY} for name in models],
    }


def _served_model(body: object, models: Mapping[str, ServedModel], protocol: str, limits: RequestLimits) -> ServedModel:
    """The model the body names, once the body is within bounds: before any work for it."""
    if not isinstance(body, Mapping):
        raise invalid_request("the request body must be a JSON object")
    check_request_bounds(protocol, body, limits)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise invalid_request("`model` is required and must be a string", "model")
    if name not in models:
        raise ApiError(
            404, "not_found_error", f"The model `{name}` does not exist; available: {', '.join(models)}", "model"
        )
    return models[name]
