"""The connector of a request continued from the tokens another engine sampled (a failover's resume
from a checkpoint): its KV comes from the global store for every full block stored, its prompt's
stored tail too, and the rest is recomputed; its resume is counted (ResumeStats)."""

from workers.engine.connectors.base import KVArrival, KVConnector, refuse_new_request_options
from workers.engine.connectors.store import StoreConnector
from workers.engine.request import Request
from workers.engine.resumption import ResumeStats
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import InvalidRequestError


class ResumeConnector(KVConnector):
    def __init__(self, store: StoreConnector | None, stats: ResumeStats) -> None:
        self.store = store
        self.stats = stats

    def check(self, request: EngineRequest) -> None:
        if self.store is None:
            raise InvalidRequestError(
                f"request {request.request_id!r} continues from its tokens, whose KV comes from the KV store; "
                "this engine has none"
            )
        refuse_new_request_options(request, "continued from its tokens")

    def load(self, request: Request) -> KVArrival:
        self.stats.start(request)
        return self.store.load(request)
