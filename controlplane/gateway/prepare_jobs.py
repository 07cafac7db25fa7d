"""The work of preparing one request body: JSON parsing, the model it names, and the recipe's
rendering and tokenizing. The same function runs in a gateway thread and in a prepare process
(prepare_process), so that both refuse a body alike."""

from dataclasses import dataclass
from typing import Literal

from controlplane.gateway.catalog import Catalog, require_model
from controlplane.gateway.request_body import parse_json_body
from recipe.api import PreparedRequest, RequestImage, RequestLimits, count_tokens, prepare_request


@dataclass(frozen=True, slots=True)
class PrepareJob:
    kind: Literal["generation", "count_tokens"]
    protocol: str
    body: bytes
    limits: RequestLimits
    # A generation's images as a prepare process read them (fetched, decoded): the gateway thread that
    # prepares it again takes them from there. None: they are read by this job.
    images: tuple[RequestImage, ...] | None = None


def run_job(job: PrepareJob, catalog: Catalog) -> PreparedRequest | int:
    """The prepared request, or the prompt's length for count_tokens. Raises the GatewayError or the
    recipe's ApiError that refuses the body."""
    body = parse_json_body(job.body)
    require_model(body, catalog)
    if job.kind == "count_tokens":
        return count_tokens(body, catalog.models, job.limits)
    return prepare_request(job.protocol, body, catalog.models, job.limits, job.images)
