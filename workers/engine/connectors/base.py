"""The KV connector interface: where a request's KV comes from when it is added, and where the KV
it computes goes.

An EngineRequest says which connector state it brings (`kv`, workers.protocol.engine_request); the
engine hands the request to the one connector that serves that source and asks it:
- `check(request)`: whether it can serve the request at all: InvalidRequestError naming why, before
  anything changes (a continued request on an engine without a store; a handed-over request whose KV
  never arrived here);
- `load(request)`: bring in the KV it supplies for the request the engine just built, and say where
  the request goes (a KVArrival);
- `discard(request_id)`: the engine refused the request: whatever the connector held for it goes;
- `save(requests)`: after each step, keep what these requests computed (the store does).

Backends: the prompt computed here, with the global store when there is one (connectors.store, or
ComputeHere without a store); the prefill→decode handoff and migrations (connectors.handoff); a
request continued from its tokens, with the store (connectors.resume).
"""

import enum
from collections.abc import Sequence

from workers.engine.request import Request
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import InvalidRequestError


class KVArrival(enum.Enum):
    # It waits for the scheduler, which computes what the connector does not bring (a store fetch
    # may still be under way).
    WAITING = "waiting"
    # Its pages are held while a transfer writes its KV (page to page): the engine's admit_prefilled
    # or cancel_prefilled follows.
    RESERVED = "reserved"
    # Its KV is in its pages: it joins the running batch, its next step a decode.
    READY = "ready"


class KVConnector:
    """Defaults for a connector that checks nothing, holds nothing for a refused request, and saves
    nothing; `load` is each backend's own."""

    def check(self, request: EngineRequest) -> None:
        return None

    def load(self, request: Request) -> KVArrival:
        raise NotImplementedError

    def discard(self, request_id: str) -> None:
        return None

    def save(self, requests: Sequence[Request]) -> None:
        return None


class ComputeHere(KVConnector):
    """An engine without a store: the prompt's KV comes from the local prefix cache, or is computed."""

    def load(self, request: Request) -> KVArrival:
        return KVArrival.WAITING


def refuse_new_request_options(request: EngineRequest, how: str) -> None:
    """InvalidRequestError for what only a request computed from its prompt can have: its prompt's
    logprobs (its prompt ran elsewhere), a prefill-only end, cache hints (its prompt's blocks are
    the first engine's to store)."""
    if request.prompt_logprobs is not None or request.prefill_only or request.cache_hints:
        raise InvalidRequestError(
            f"request {request.request_id!r} is {how}: prompt logprobs, prefill_only and cache hints "
            "are for a request whose prompt is computed here"
        )
