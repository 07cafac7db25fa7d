"""The engine's side of disaggregated serving: the KV a prefill engine exports, and the KV a decode
engine takes in.

Prefill side: a prefill-only request that finished with "transfer" is held here, its pages pinned,
until the caller has read `export_kv(request_id)` and called `release(request_id)`; the exports read
from those pages are closed on release, so a late read cannot see reused pages.

Decode side: a handoff is checked against this engine's model and cache and becomes a Request with
pages for every token (those the prefix cache already holds are shared, not written again): a
reservation. Its KV is written into the other pages, from host layers at once or page to page by a
transfer backend while the engine steps on (workers.transfer), and the request joins the running
batch once it is there (admit), or gives its pages back (cancel).

As the engine's KV connector for a request handed over (a Prefilled or Migrated EngineRequest), the
transfer that brought the KV first leaves it here under the request's id (`receive`); adding the
request takes it: host layers are written at once and the request runs, another engine's pages are
copied in by the caller between the reservation and admit.
"""

from workers.engine.connectors.base import KVArrival, KVConnector, refuse_new_request_options
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv_handoff import KVHandoff, PagedLayers, check_handoff, check_layers, export_handoff, write_layers
from workers.engine.request import Request
from workers.engine.structured.constraint import TokenConstraint
from workers.protocol.engine_request import EngineRequest, Migrated, Prefilled
from workers.protocol.errors import EngineOverloadedError, InvalidRequestError
from workers.protocol.messages import OutputConstraintSpec


class Disaggregation(KVConnector):
    def __init__(self, kv_cache: KVCache, block_manager: BlockManager, *, kv_model_id: str, vocab_size: int) -> None:
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.kv_model_id = kv_model_id
        self.vocab_size = vocab_size
        # Finished prefill-only requests whose pages stay pinned until release, and the exports read
        # from those pages.
        self.transfers: dict[str, Request] = {}
        self.exports: dict[str, list[PagedLayers]] = {}
        # Continued requests holding pages their KV is being written into, not yet running, and the
        # first token whose KV the caller copies in (for those copied page to page).
        self.reserved: dict[str, Request] = {}
        self.starts: dict[str, int] = {}
        # KV received for requests not yet added, and whether the caller copies it in page to page.
        self.pending: dict[str, tuple[KVHandoff, bool]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.transfers

    def __len__(self) -> int:
        return len(self.transfers)

    def hold(self, request: Request) -> None:
        """Pin a request that finished with "transfer" until it is released."""
        self.transfers[request.request_id] = request

    def export_kv(self, request_id: str) -> KVHandoff:
        """The handoff of a held request. Its layers are read from the pinned pages as they are
        accessed: read them before release."""
        request = self.transfers.get(request_id)
        if request is None:
            raise InvalidRequestError(f"request {request_id!r} is not awaiting a KV transfer")
        layers = PagedLayers(
            self.kv_cache, request.pages, request.num_computed_tokens, window_pages=self._window_pages(request)
        )
        self.exports.setdefault(request_id, []).append(layers)
        return export_handoff(request, layers, self.kv_model_id)

    def take_back(self, request_id: str) -> Request | None:
        """Stop holding a request without freeing its pages (it runs here again); None when not held.
        Exports read from its pages are closed: they belong to a transfer that will not happen."""
        request = self.transfers.pop(request_id, None)
        if request is not None:
            for layers in self.exports.pop(request_id, []):
                layers.close()
        return request

    def release(self, request_id: str) -> bool:
        """Unpin a held request's pages; False when none were pinned for it."""
        request = self.transfers.pop(request_id, None)
        if request is None:
            return False
        for layers in self.exports.pop(request_id, []):
            layers.close()
        self.block_manager.free(request)
        return True

    def receive(self, handoff: KVHandoff, *, copied_in: bool = False) -> None:
        """KV for a request about to be added (workers.transfer): its host layers, or with `copied_in`
        the other engine's pages, which the caller copies into the pages the request is given."""
        self.pending[handoff.request_id] = (handoff, copied_in)

    def check(self, request: EngineRequest) -> None:
        """That KV arrived for the request, of its tokens; else InvalidRequestError."""
        name = request.request_id
        refuse_new_request_options(request, "handed over")
        pending = self.pending.get(name)
        if pending is None:
            raise InvalidRequestError(f"request {name!r} continues a KV handoff, but no KV arrived for it here")
        handoff = pending[0]
        ours = (request.prompt_token_ids, request.kv.output_token_ids, request.kv.num_cached_tokens)
        theirs = (handoff.prompt_token_ids, handoff.output_token_ids, handoff.num_cached_tokens)
        if ours != theirs:
            raise InvalidRequestError(f"the KV that arrived for request {name!r} is of other tokens")
        if (request.params, request.cache_namespace, request.traffic_class) != (
            handoff.params,
            handoff.cache_namespace,
            handoff.traffic_class,
        ):
            raise InvalidRequestError(f"the KV that arrived for request {name!r} is of other params or namespace")

    def handoff_of(self, request_id: str) -> KVHandoff:
        """The KV received for a request being added (check has found it)."""
        return self.pending[request_id][0]

    def load(self, request: Request) -> KVArrival:
        """Pages for the request (EngineOverloadedError when there are none), then its KV: written
        from host layers now (READY), or left for the caller to copy (RESERVED)."""
        handoff, copied_in = self.pending.pop(request.request_id)
        start = self.reserve(request, handoff)
        if copied_in:
            self.starts[request.request_id] = start
            return KVArrival.RESERVED
        try:
            write_layers(
                self.kv_cache,
                request.pages,
                check_layers(handoff),
                start=start,
                window_pages=self._window_pages(request),
            )
        except BaseException:
            self.cancel(request.request_id)
            raise
        return KVArrival.READY

    def _window_pages(self, request: Request) -> list[list[int]]:
        """The request's page tables of the KV groups after the first (sliding windows)."""
        return [self.block_manager.pages_of(request, group) for group in range(1, len(self.block_manager.pools))]

    def discard(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def fits(self, handoff: KVHandoff, *, max_tokens: int) -> None:
        """That the handoff fits this engine; else InvalidRequestError."""
        check_handoff(
            handoff,
            kv_model_id=self.kv_model_id,
            vocab_size=self.vocab_size,
            max_tokens=max_tokens,
            kv_cache=self.kv_cache,
        )

    def reserve(self, request: Request, handoff: KVHandoff) -> int:
        """Give a continued request pages for every token, the pending sampled one included (so its
        decode step needs none), and hold it until admit or cancel; the first token whose KV must be
        written (those before it are the prefix cache's). EngineOverloadedError (and nothing
        changed) when the pages cannot be had."""
        manager = self.block_manager
        cached = manager.find_cached_prefix(request)
        windows = [window for window in manager.windows if window is not None]
        # A hybrid model's window pages: only those of the window its first decode step reads, all
        # filled from the handoff (write_layers), whatever the prefix cache holds.
        window_start = max(handoff.num_computed_tokens - max(windows) + 1, 0) if windows else None
        cached_tokens = len(cached[0]) * manager.page_size
        if not manager.allocate(request, request.num_tokens - cached_tokens, cached, window_start=window_start):
            raise EngineOverloadedError(
                f"no room for {request.num_tokens} tokens of KV: "
                f"{self.block_manager.num_free_pages} of {self.block_manager.num_usable_pages} pages are free"
            )
        request.num_computed_tokens = handoff.num_computed_tokens
        self.reserved[request.request_id] = request
        return cached_tokens

    def admit(self, request_id: str) -> Request:
        """A reserved request whose KV is in its pages: its full pages are keyed for the prefix cache."""
        request = self.reserved.pop(request_id)
        self.starts.pop(request_id, None)
        self.block_manager.cache_full_pages(request)
        return request

    def cancel(self, request_id: str) -> Request | None:
        """Free a reserved request's pages; None when it is not reserved."""
        request = self.reserved.pop(request_id, None)
        self.starts.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)
        return request


def continued_request(
    handoff: KVHandoff, *, max_tokens: int, hash_extra: bytes, constraint: TokenConstraint | None
) -> Request:
    """The Request that continues a handoff on this engine (its KV not yet placed)."""
    return Request(
        request_id=handoff.request_id,
        prompt_token_ids=list(handoff.prompt_token_ids),
        params=handoff.params,
        max_tokens=max_tokens,
        hash_extra=hash_extra,
        cache_namespace=handoff.cache_namespace,
        output_token_ids=list(handoff.output_token_ids),
        traffic_class=handoff.traffic_class,
        num_cached_tokens=handoff.num_cached_tokens,
        constraint=constraint,
    )


def continuing(handoff: KVHandoff, constraint: OutputConstraintSpec | None = None) -> EngineRequest:
    """The EngineRequest that continues a handoff, once its KV is given to the engine's handoff
    connector (Disaggregation.receive)."""
    source = Migrated if handoff.migrated else Prefilled
    return EngineRequest(
        request_id=handoff.request_id,
        prompt_token_ids=list(handoff.prompt_token_ids),
        params=handoff.params,
        kv=source(output_token_ids=list(handoff.output_token_ids), num_cached_tokens=handoff.num_cached_tokens),
        cache_namespace=handoff.cache_namespace,
        constraint=constraint,
        traffic_class=handoff.traffic_class,
        images=handoff.images,
    )
