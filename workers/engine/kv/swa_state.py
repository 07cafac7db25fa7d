"""SWA state in host memory: the sliding-window group's KV of the blocks a worker computed, kept so that
a later request that hits the same prefix (here, or on another worker that fetches it) continues
without replaying the window (DESIGN.md, "Sliding windows and bounded replay").

The cache holds one entry per store block, keyed by the block's chained hash
(workers.kvstore.block_hash): the SWA group's KV of that block's tokens as a token-major run
(KVCacheSpec.run_shape). The state at a prefix end is the run of every block the window reaches back
into (`window_keys`), so consecutive prefix ends of one conversation share their blocks instead of
each keeping W tokens of its own.

A window counts the query itself (KVCacheSpec.window), so a request continuing at a prefix end reads
the KV of the W - 1 tokens before it: `window_blocks` blocks of them (workers.kvstore.swa_window,
torch-free for the entrypoint's routing).

Bounded by bytes, least recently used first out: a put, a `window` that found its blocks and a `get`
(another worker's fetch) count as uses. `on_evict` hears of the blocks that went, so that their "held
by this worker" registrations (workers.kvstore.holders) go too; it is called outside the cache's lock.
Thread-safe: the engine puts while the thread that answers other workers' fetches reads.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from workers.engine.kv.spec import KVCacheSpec, KVKind
from workers.engine.kv.swa_stats import SwaStats
from workers.kvstore.block_hash import BlockHash
from workers.kvstore.swa_window import window_keys


class SwaStateError(ValueError):
    """A run that is not the SWA KV of one block as this cache lays it out."""


class SwaStateCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        block_tokens: int,
        capacity_bytes: int,
        *,
        on_evict: Callable[[list[BlockHash]], None] = lambda keys: None,
    ) -> None:
        """`spec` is the sliding-window group's; `block_tokens` the store's block length (a run's
        tokens); nothing is kept with a `capacity_bytes` under one run."""
        if spec.kind is not KVKind.SLIDING_WINDOW:
            raise ValueError(f"SWA state is a sliding-window group's KV; got a {spec.kind} group")
        if block_tokens < 1 or capacity_bytes < 0:
            raise ValueError(
                f"block_tokens must be positive and capacity_bytes >= 0, got {block_tokens}, {capacity_bytes}"
            )
        self.spec = spec
        self.block_tokens = block_tokens
        self.capacity_bytes = capacity_bytes
        self.run_shape = spec.run_shape(block_tokens)
        self.run_bytes = spec.bytes_per_token * block_tokens
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._runs: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()  # least recently used first
        # Counters (the worker's /metrics): windows found whole or not, blocks put and evicted.
        self.num_hits = 0
        self.num_misses = 0
        self.num_puts = 0
        self.num_evictions = 0

    @property
    def layout(self) -> str:
        """The runs' layout, which a fetch reply names (KVCacheSpec.layout)."""
        return self.spec.layout

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return len(self._runs) * self.run_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)

    def __contains__(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._runs

    def put(self, key: BlockHash, run: torch.Tensor) -> bool:
        """Keep the SWA KV of the block `key` (a run of `run_shape` and the spec's storage dtype, in host
        memory); False when the capacity holds no run. A key held already keeps its run (the same
        tokens give the same KV) and counts as used."""
        self.check_run(run)
        if self.run_bytes > self.capacity_bytes:
            return False
        # A view into a bigger buffer would keep all of it alive, uncounted.
        if not run.is_contiguous() or run.untyped_storage().nbytes() != self.run_bytes:
            run = run.clone(memory_format=torch.contiguous_format)
        with self._lock:
            if key in self._runs:
                self._runs.move_to_end(key)
                return True
            self._runs[key] = run
            self.num_puts += 1
            evicted = []
            while len(self._runs) * self.run_bytes > self.capacity_bytes:
                evicted.append(self._runs.popitem(last=False)[0])
            self.num_evictions += len(evicted)
        if evicted:
            self.on_evict(evicted)
        return True

    def get(self, keys: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Each key's run, None for a key not held (what a fetch server sends another worker): a use
        of each found."""
        with self._lock:
            runs = [self._runs.get(key) for key in keys]
            for key, run in zip(keys, runs):
                if run is not None:
                    self._runs.move_to_end(key)
        return runs

    def window(self, prefix_keys: Sequence[BlockHash]) -> list[torch.Tensor] | None:
        """The SWA state at the end of the prefix `prefix_keys`: the runs of its `window_keys`, oldest
        first; None unless every one is held."""
        keys = window_keys(prefix_keys, self.spec.window, self.block_tokens)
        with self._lock:
            runs = [self._runs.get(key) for key in keys]
            if any(run is None for run in runs):
                self.num_misses += 1
                return None
            for key in keys:
                self._runs.move_to_end(key)
            self.num_hits += 1
        return runs

    def check_run(self, run: torch.Tensor) -> None:
        """SwaStateError unless `run` is one block's SWA KV as this cache keeps it."""
        if not isinstance(run, torch.Tensor):
            raise SwaStateError(f"an SWA state run is a tensor, got {type(run).__name__}")
        if run.dtype != self.spec.storage_dtype:
            raise SwaStateError(f"an SWA state run is {self.spec.storage_dtype} ({self.layout}), got {run.dtype}")
        if tuple(run.shape) != self.run_shape:
            raise SwaStateError(
                f"an SWA state run is [layers, planes, heads, tokens, width] = {list(self.run_shape)} "
                f"({self.layout}, {self.block_tokens} tokens a block), got {list(run.shape)}"
            )
        if run.device.type != "cpu":
            raise SwaStateError(f"SWA state is kept in host memory; copy the run off {run.device} first")


class SwaStateSource(Protocol):
    """Where an engine keeps the SWA state of the blocks it stores and finds the state at a store hit's
    end: its own cache (LocalSwaState, the offline engine's), or a worker's holder that also serves
    and fetches it across workers (workers.worker.swa_holder.SwaStateHolder)."""

    cache: SwaStateCache

    def kept(self, keys: Sequence[BlockHash], runs: Sequence[torch.Tensor]) -> None:
        """The engine stored the blocks `keys`; `runs` are their SWA KV, in host memory."""

    def fetch_window(self, prefix_keys: Sequence[BlockHash]) -> list[torch.Tensor] | None:
        """The runs of the window before the end of the prefix `prefix_keys`, oldest first; None when
        the state cannot be had whole (the hit then backs off and replays)."""


class LocalSwaState:
    """An engine's own SWA state, in its cache only, counted in its SwaStats."""

    def __init__(self, cache: SwaStateCache, stats: SwaStats) -> None:
        self.cache = cache
        self.stats = stats

    def kept(self, keys: Sequence[BlockHash], runs: Sequence[torch.Tensor]) -> None:
        for key, run in zip(keys, runs, strict=True):
            self.cache.put(key, run)

    def fetch_window(self, prefix_keys: Sequence[BlockHash]) -> list[torch.Tensor] | None:
        runs = self.cache.window(prefix_keys)
        if runs is None:
            self.stats.state_misses += 1
        else:
            self.stats.state_hits += 1
        return runs
