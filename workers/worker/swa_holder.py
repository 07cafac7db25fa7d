"""The SWA state a worker keeps and fetches (DESIGN.md, "Sliding windows and bounded replay").

The global store keeps a sliding-window model's full-attention blocks only; the sliding-window layers'
KV of each block a worker computes stays in its host memory (workers.engine.kv.swa_state), and the
holder index (workers.kvstore.holders) says "held by worker X". A `SwaStateHolder` owns both sides of
that promise for one worker:
- `kept(keys, runs)`: the engine computed these blocks; their runs go into the cache and their keys
  into the index, one index call per call; the blocks the cache evicts meanwhile leave the index in
  the same call;
- answering other workers' fetches (`serve`: a SwaStateServer on a thread of its own, since one
  engine step can outlast a fetcher's deadline);
- `fetch_window(prefix_keys)`: the state at a prefix end for the engine, from this cache, else from a
  live holder (the index names it, SwaPeers knows where it is), counted in SwaStats;
- the index forgets this worker's earlier life as the holder starts, and this one at a clean `close`.

Index calls fail soft: a registration is a promise, and a failure to make or withdraw one costs
another worker a replay or a "missing" answer, never this worker a request.
"""

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import zmq

from workers import curve
from workers.engine.engine_core import EngineCore
from workers.engine.kv.swa_state import SwaStateCache
from workers.engine.kv.swa_stats import SwaStats
from workers.kvstore.block_hash import BlockHash
from workers.kvstore.holders import HolderIndex, check_worker_id
from workers.kvstore.store import open_holders
from workers.kvstore.swa_window import window_keys
from workers.protocol.messages import MAX_SWA_STATE_KEYS
from workers.transfer.swa_fetch import SwaStateFetcher, SwaStateServer
from workers.worker.args import WorkerArgs
from workers.worker.swa_peers import SwaPeers

log = logging.getLogger(__name__)
T = TypeVar("T")

# Holders one fetch_window asks in turn: each may cost a fetch deadline (FETCH_TIMEOUT_S) when it has
# gone, and past two a replay is the cheaper wait.
MAX_HOLDERS_TRIED = 2


def swa_state_bind_endpoint(request_endpoint: str) -> str:
    """Where the SWA state socket binds when --swa-state-endpoint is not given: beside the request
    endpoint (an ipc or inproc path + ".swa"; a tcp one's host, on a port the system picks)."""
    scheme, _, address = request_endpoint.partition("://")
    if scheme == "tcp":
        host, _, _ = address.rpartition(":")
        return f"tcp://{host}:0"
    return f"{request_endpoint}.swa"


class SwaStateHolder:
    def __init__(
        self,
        worker_id: str,
        cache: SwaStateCache,
        holders: HolderIndex,
        fetcher: SwaStateFetcher,
        *,
        peers: SwaPeers | None = None,
        stats: SwaStats | None = None,
    ) -> None:
        """`cache`: this worker's (its on_evict is taken over); `holders`: the index shared with the
        other workers; `fetcher`: for this worker's SWA layout; `stats`: where the state lookups are
        counted (the engine's SwaStats)."""
        self.worker_id = check_worker_id(worker_id)
        self.cache = cache
        self.holders = holders
        self.fetcher = fetcher
        self.peers = peers or SwaPeers()
        self.stats = stats or SwaStats()
        self.endpoint = ""  # the bound SWA state endpoint, once serving
        cache.on_evict = self._on_evict
        self._evicted: list[BlockHash] = []
        self._lock = threading.Lock()  # one kept() at a time: its evictions are its own
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._index_failing = False
        # An earlier life under this id may have registered blocks this one does not hold.
        self._index("dropping an earlier life's registrations", holders.drop_worker, self.worker_id)

    def serve(self, endpoint: str, context: zmq.Context, *, key: curve.CurveKey | None = None) -> str:
        """Answer other workers' fetches at `endpoint` on a thread of its own; returns the endpoint as
        bound (a tcp port 0 resolved)."""
        server = SwaStateServer(self.cache, endpoint, context, key=key)
        self.endpoint = server.endpoint
        self._thread = threading.Thread(target=server.serve, args=(self._stop,), name="swa-state-server", daemon=True)
        self._thread.start()
        return self.endpoint

    def kept(self, keys: Sequence[BlockHash], runs: Sequence[torch.Tensor]) -> None:
        """The engine computed the blocks `keys`; `runs` are their SWA KV (KVCacheSpec.run_shape of the
        store's block length, in host memory), in the same order."""
        if len(keys) != len(runs):
            raise ValueError(f"kept {len(keys)} keys with {len(runs)} runs")
        with self._lock:
            held = [key for key, run in zip(keys, runs) if self.cache.put(key, run)]
            evicted, self._evicted = self._evicted, []
        if held:
            self._index("registering kept blocks", self.holders.register, held, self.worker_id)
        # A block evicted and put again within this call is held: it stays registered.
        if gone := [key for key in evicted if key not in self.cache]:
            self._index("dropping evicted blocks", self.holders.drop, gone, self.worker_id)

    def fetch_window(self, prefix_keys: Sequence[BlockHash]) -> list[torch.Tensor] | None:
        """The SWA state at the end of the prefix `prefix_keys` (the block keys of a hit, at least one):
        the runs of its window's blocks, oldest first, from this worker's cache or fetched from a live
        holder (then kept here too); None when neither has it whole, and the hit backs off."""
        if not prefix_keys:
            raise ValueError("fetch_window needs the keys of a prefix of at least one block")
        runs = self.cache.window(prefix_keys)
        if runs is not None:
            self.stats.state_hits += 1
            return runs
        keys = window_keys(prefix_keys, self.cache.spec.window, self.cache.block_tokens)
        fetched = self._fetch(keys) if len(keys) <= MAX_SWA_STATE_KEYS else None
        if fetched is None:
            self.stats.state_misses += 1
            return None
        self.stats.state_fetches += 1
        self.kept(keys, fetched)
        return fetched

    def close(self) -> None:
        """Stop serving and withdraw every registration: this worker's state goes with it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.fetcher.close()
        self._index("dropping this worker's registrations", self.holders.drop_worker, self.worker_id)

    def _fetch(self, keys: list[BlockHash]) -> list[torch.Tensor] | None:
        """The runs of `keys` from the first live holder that has them all."""
        found = self._index("looking up holders", self.holders.holders_of_all, keys) or set()
        endpoints = [self.peers.endpoint(worker) for worker in sorted(found - {self.worker_id})]
        for endpoint in [endpoint for endpoint in endpoints if endpoint][:MAX_HOLDERS_TRIED]:
            runs = self.fetcher.fetch(endpoint, keys).window()
            if runs is not None:
                return runs
        return None

    def _on_evict(self, keys: list[BlockHash]) -> None:
        self._evicted.extend(keys)  # only put() evicts, within kept(), under its lock

    def _index(self, what: str, call: Callable[..., T], *args: object) -> T | None:
        """`call(*args)` on the holder index; None when it fails (said once until it answers again)."""
        try:
            result = call(*args)
        except Exception as error:
            if not self._index_failing:
                log.warning("SWA holder index: %s failed: %s", what, error)
            self._index_failing = True
            return None
        self._index_failing = False
        return result


def open_swa_holder(
    config: WorkerArgs,
    engine: EngineCore,
    context: zmq.Context,
    *,
    worker_id: str,
    key: curve.CurveKey | None = None,
) -> SwaStateHolder | None:
    """The worker's holder of its engine's SWA state, serving fetches, and the engine's source of it:
    None for a model without a single window group, without a KV store (no hit to continue from) or
    with --swa-state-bytes 0."""
    info = engine.info
    spec = info.swa_state_spec
    if spec is None or not info.kv_block_tokens or not config.engine.swa_state_bytes:
        return None
    cache = SwaStateCache(spec, info.kv_block_tokens, config.engine.swa_state_bytes)
    fetcher = SwaStateFetcher(spec, info.kv_block_tokens, context, key=key)
    holders = open_holders(config.engine.kv_store_index)
    holder = SwaStateHolder(worker_id, cache, holders, fetcher, stats=engine.stats().swa)
    holder.serve(config.swa_state_endpoint or swa_state_bind_endpoint(config.request_endpoint), context, key=key)
    engine.use_swa_state(holder)
    return holder
