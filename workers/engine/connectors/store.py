"""Moves KV between the engine's pages and the global block store (workers.kvstore).

A store block is `block_tokens` tokens (a multiple of the page size), keyed by the same chained
hash as the engine's pages (workers.kvstore.block_hash) with the same `extra`, only over longer blocks. It
holds the KV of the cache's first group (workers.engine.kv.spec), the one the global store keeps, and
its file records that group's layout: a block of another layout ends a fetch as a corrupt one does.

Reads: when a request arrives, the index says how many of its prompt's blocks the store holds
(no data read). If that beats the engine-local prefix cache, a reader thread fetches the blocks
into host memory while the request waits; the scheduler admits it once they are in, and the step
that admits it copies them into its pages before the model runs. A missing or corrupt block ends
the fetch there: the rest is recomputed.

Writes: after each step, blocks that became full of computed tokens whose ids are known (prompt or
output: the next turn of a conversation contains this turn's answer; with async scheduling a
block whose last token is still pending waits a step) are copied out of their pages and written by
a writer thread, off the critical path. On a GPU the copy goes into one of a few pinned staging
buffers without waiting for the device (the writer waits for the copy's event), so storing blocks
does not stall the overlap of host and device. When the writer falls behind, or no staging buffer
is free, new blocks are dropped rather than stalling the engine.

Cache hints (workers.kvstore.hints): the leading blocks a request's hints cover are written with a
`retain_until`, and those already stored (a hit, or written by an earlier request) are retained
again from now, as a cache entry is refreshed when it is used. Retaining goes through the writer
thread too, so a remote index costs the step no round trip. Hinted blocks have a share of the write
queue of their own: other blocks are dropped once the queue is `UNHINTED_WRITES_MAX` long, hinted ones
only when it is full.

A hybrid model (a full-attention group and sliding windows): the store keeps the full group's KV only,
and a hit of h tokens would also need the windows' KV of the tokens before h, which the store does
not hold: it is replayed (workers.engine.kv.window_replay), or, where the attention backend cannot
replay, the hit is not taken (`window_state_for_hit`, where fetching that state from the workers that
computed it will plug in). Blocks computed after an approximate replay are never stored.

Prompt tails: a prompt that ends inside a block leaves that block partial until the output fills
it. A decode worker that checkpoints its requests for failover also stores the tail's whole pages
(store_prompt_tail) under a key of their own, chained to the prompt's last full block, so that a
worker resuming the request (its output tokens given) fetches the tail with the full blocks and
recomputes only the tokens generated since the last full block, not the prompt's end as well.
"""

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from workers.engine.connectors.base import KVArrival, KVConnector
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.kv_pages import gather_tokens, scatter_tokens
from workers.engine.kv.swa_state import SwaStateSource
from workers.engine.kv.swa_stats import SwaStats
from workers.engine.request import Request
from workers.kvstore.block_hash import ROOT_HASH, BlockHash, hash_block, reusable_blocks
from workers.kvstore.hints import BlockRetention, RetentionCaps, plan_retention
from workers.kvstore.store import KVStore
from workers.protocol.messages import CacheHint

log = logging.getLogger(__name__)

# Blocks waiting for the writer thread; past this, new blocks are not stored (counted as dropped).
MAX_PENDING_WRITES = 256
# Blocks no cache hint covers are dropped once this many writes wait: the rest of the queue is for
# hinted blocks.
UNHINTED_WRITES_MAX = 192
# Pinned host buffers that blocks are copied into from a GPU's pages: writes in flight on a GPU.
STAGING_BLOCKS = 16
READER_THREADS = 2
# Folded into a prompt tail's key: its tokens are fewer than a block's, and never a block of their own.
TAIL_EXTRA = b"\x00prompt tail"


@dataclass(frozen=True, slots=True)
class LoadedBlocks:
    """Store blocks fetched into host memory for one request, in page units."""

    first_page: int
    num_pages: int
    # One tensor per block: [layers, planes, heads, block_tokens, width] of the stored
    # group's layers; a prompt tail, last, holds fewer tokens (whole pages).
    blocks: list[torch.Tensor]
    # A hybrid model's SWA state at the blocks' end (SwaStateSource.fetch_window): the window group's
    # runs, oldest first; None: the hit backed off one block and the scheduler replays the window.
    window_runs: list[torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Copy `blocks` into `pages` (as many pages as the blocks hold tokens) before the step runs, and
    a hybrid model's SWA state `window_runs` into its window group's `window_pages`."""

    pages: list[int]
    blocks: list[torch.Tensor]
    window_pages: list[int] = field(default_factory=list)
    window_runs: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StoreStats:
    num_hit_tokens: int  # prompt tokens fetched from the store instead of computed
    num_blocks_read: int
    num_blocks_written: int
    num_writes_dropped: int
    # Bytes of the written blocks' tokens that the sliding-window layers hold and the store does not
    # keep (a hybrid model's window state stays with its worker): what writing every layer would add.
    # Fetches from the store into host memory: how many, the bytes read, the seconds they took.
    num_fetches: int = 0
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Write:
    """A block for the writer thread: on the host once `copied` (None: already) has completed."""

    key: BlockHash
    depth: int  # the block's index in its chain
    traffic_class: str
    new_chain: bool  # its request's prompt shared no full block with the store or the prefix cache
    block: torch.Tensor
    copied: "torch.cuda.Event | None"
    retain_until: float  # a cache hint's (time.time()), 0 without one
    staging: torch.Tensor | None = None  # the pinned buffer `block` lies in, free again once written


@dataclass(frozen=True, slots=True)
class _Retain:
    """Stored blocks for the writer thread to retain until a time (time.time())."""

    keys: list[BlockHash]
    until: float


class StoreConnector(KVConnector):
    def __init__(
        self,
        store: KVStore,
        kv_cache: KVCache,
        block_manager: BlockManager,
        *,
        block_tokens: int,
        retention_caps: RetentionCaps,
        swa_stats: SwaStats | None = None,
    ) -> None:
        self.store = store
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.block_tokens = block_tokens
        self.retention_caps = retention_caps
        self.pages_per_block = block_tokens // kv_cache.page_size
        # The request's pages are the first group's: the store keeps that group, and no other.
        self.spec = kv_cache.specs.groups[0]
        stored = [group for group in kv_cache.specs.groups if group.stored_globally]
        if stored != [self.spec]:
            raise ValueError(f"the store keeps the first KV group only; these are stored: {[g.layout for g in stored]}")
        self.block_shape = self.spec.run_shape(block_tokens)
        self.dtype = self.spec.storage_dtype
        self.block_bytes = self.spec.bytes_per_token * block_tokens
        self.window_block_bytes = sum(group.bytes_per_token for group in kv_cache.specs.groups[1:]) * block_tokens
        # A hybrid model's replays, SWA state and the window bytes the store does not write.
        self.swa_stats = swa_stats or SwaStats()
        # Where the SWA state of the blocks stored goes and a hit's comes from (use_swa_state); a
        # model of one window group only: one cache of state holds one layout.
        self.window_spec = kv_cache.specs.groups[1] if len(kv_cache.specs.groups) == 2 else None
        self.swa_state: SwaStateSource | None = None
        self.readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvstore-read")
        self.pending_writes: queue.Queue[_Write | _Retain | None] = queue.Queue(MAX_PENDING_WRITES)
        self.device = kv_cache.device
        # Free pinned staging buffers (GPU caches only: a CPU cache's blocks are plain copies).
        self.staging: queue.SimpleQueue[torch.Tensor] | None = None
        if self.device.type == "cuda":
            self.staging = queue.SimpleQueue()
            for _ in range(STAGING_BLOCKS):
                self.staging.put(torch.empty(self.block_shape, dtype=self.dtype, pin_memory=True))
        self.writer = threading.Thread(target=self._write_blocks, name="kvstore-write", daemon=True)
        self.writer.start()
        self.num_hit_tokens = 0
        self.num_blocks_read = 0
        self.num_blocks_written = 0
        self.num_writes_dropped = 0
        self.fetch_counts_lock = threading.Lock()  # the reader threads count their fetches
        self.num_fetches = 0
        self.fetch_bytes = 0
        self.fetch_seconds = 0.0
        self.index_failing = False  # the last match or contains_many failed

    def load(self, request: Request) -> KVArrival:
        """The request waits while its stored blocks past the local prefix cache's are fetched; a
        prompt whose every position runs through the model (prompt logprobs) fetches none."""
        if not request.needs_prompt_logits:
            local_pages, _ = self.block_manager.find_cached_prefix(request)
            self.start_fetch(request, local_hit_tokens=len(local_pages) * self.block_manager.page_size)
        return KVArrival.WAITING

    def start_fetch(self, request: Request, local_hit_tokens: int) -> None:
        """Fetch the request's stored blocks past what the local prefix cache holds, if any: its
        prompt's, and its output's too for a request resumed with tokens already sampled (with its
        prompt's tail, when the block it ends in was not stored whole)."""
        num_blocks = reusable_blocks(request.num_tokens, self.block_tokens)
        keys = self._keys(request, num_blocks)
        first = local_hit_tokens // self.block_tokens
        try:
            hit = self.store.match(keys)
            tail = self._prompt_tail(request) if request.output_token_ids and hit >= first else None
            if tail is not None and (tail[0] != hit or self.store.match([tail[2]]) != 1):
                tail = None
        except Exception as error:
            self._index_failed(error)
            return
        self._index_answered()
        if hit <= first and tail is None:
            return
        if not self.window_state_for_hit(request, hit * self.block_tokens):
            return
        if len(self.kv_cache.specs.groups) > 1:
            tail = None  # a tail's SWA state is not kept: its hit would replay anyway
        request.store_fetch = self.readers.submit(self._fetch, keys[:hit], first, tail)

    def window_state_for_hit(self, request: Request, hit_tokens: int) -> bool:
        """Whether the KV of the sliding-window layers for the tokens before a store hit of `hit_tokens`
        can be had, so that the hit may be taken: trivially for a model without windows, else by a
        bounded replay (kv.window_replay) where the attention backend runs one. This is where a
        source of window state (a cross-worker cache) plugs in: when it holds the window before the
        hit, it fills those window pages before the step that admits the request, and the scheduler
        takes the hit without a replay (BlockManager.replay_for_hit)."""
        windowed = len(self.kv_cache.specs.groups) > 1
        return not windowed or self.block_manager.replay is not None or self.swa_state is not None

    def use_swa_state(self, source: SwaStateSource) -> None:
        """Keep the SWA state of the blocks stored from now on in `source`, and take a store hit's from
        it (see the module docstring)."""
        if self.window_spec is None or source.cache.layout != self.window_spec.layout:
            raise ValueError(
                f"SWA state of {source.cache.layout!r} does not fit this cache ({self.kv_cache.specs.layout})"
            )
        if source.cache.block_tokens != self.block_tokens:
            raise ValueError(
                f"SWA state of {source.cache.block_tokens}-token blocks; the store's have {self.block_tokens}"
            )
        self.swa_state = source

    @torch.inference_mode()
    def store_prompt_tail(self, request: Request) -> None:
        """Queue the write of the request's prompt tail (see the module docstring), once: when its
        KV is computed and the block the prompt ends in is not full yet (a full one is stored as such)."""
        if request.prompt_tail_stored:
            return
        if request.num_reusable_tokens < request.num_computed_tokens:
            request.prompt_tail_stored = True  # its KV past an approximate window replay is not stored
            return
        tail = self._prompt_tail(request)
        if tail is None or request.num_known_tokens >= (tail[0] + 1) * self.block_tokens:
            request.prompt_tail_stored = True
            return
        index, tokens, key = tail
        if request.num_computed_tokens < index * self.block_tokens + tokens or self.pending_writes.full():
            return
        first_page = index * self.pages_per_block
        write = self._copy_out(key, index, request, first_page, tokens // self.kv_cache.page_size, 0.0)
        if write is not None:
            self.pending_writes.put(write)
            request.prompt_tail_stored = True

    def plan_retention(self, hints: Sequence[CacheHint]) -> tuple[BlockRetention, ...]:
        """How a request with these hints keeps its leading blocks, within this worker's caps."""
        return plan_retention(hints, self.block_tokens, self.retention_caps)

    @torch.inference_mode()
    def copy_in(self, loads: list[KVLoad]) -> None:
        page_size = self.kv_cache.page_size
        for load in loads:
            self.num_hit_tokens += len(load.pages) * page_size
            self.num_blocks_read += len(load.blocks)
            pages = torch.tensor(load.pages, device=self.kv_cache.layers[0][0].device)
            for index, layer in enumerate(self.spec.layers):
                for plane, cache in enumerate(self.kv_cache.layers[layer]):
                    scatter_tokens(cache, pages, torch.cat([block[index, plane] for block in load.blocks], dim=1))
            if load.window_runs:
                window_pages = torch.tensor(load.window_pages, device=pages.device)
                for index, layer in enumerate(self.window_spec.layers):
                    for plane, cache in enumerate(self.kv_cache.layers[layer]):
                        runs = torch.cat([run[index, plane] for run in load.window_runs], dim=1)
                        scatter_tokens(cache, window_pages, runs)

    @torch.inference_mode()
    def save(self, requests: Sequence[Request]) -> None:
        """Queue the requests' blocks that became full of computed, known tokens and are not stored
        yet (those a cache hint covers with their retain_until; stored ones it covers are retained
        again). The store is asked about all of them at once: one index round trip per step."""
        completed = []  # (request, first unsaved block, full blocks, their keys)
        for request in requests:
            full = min(request.num_reusable_tokens, request.num_known_tokens) // self.block_tokens
            if full > request.num_saved_blocks:
                completed.append((request, request.num_saved_blocks, full, self._keys(request, full)))
        if not completed:
            return
        try:
            stored = iter(
                self.store.contains_many([key for _, first, full, keys in completed for key in keys[first:full]])
            )
        except Exception as error:
            self._index_failed(error)
            return  # the blocks are looked at again next step
        self._index_answered()
        now = self.store.clock()
        window_keys: list[BlockHash] = []
        window_runs: list[torch.Tensor] = []
        for request, first, full, keys in completed:
            present = [next(stored) for _ in range(first, full)]
            retained: dict[float, list[BlockHash]] = {}  # stored blocks a hint covers, by retain_until
            for index in range(first, full):
                kept = request.retention[index] if index < len(request.retention) else None
                retain_until = now + kept.seconds if kept is not None else 0.0
                if present[index - first]:
                    if kept is not None:
                        retained.setdefault(retain_until, []).append(keys[index])
                    continue
                room = MAX_PENDING_WRITES if kept is not None else UNHINTED_WRITES_MAX
                first_page = index * self.pages_per_block
                write = (
                    self._copy_out(keys[index], index, request, first_page, self.pages_per_block, retain_until)
                    if self._queued() < room
                    else None
                )
                if write is None:
                    self.num_writes_dropped += full - index
                    break
                self.pending_writes.put(write)
                self._count_stored(request, index, kept)
                if self.swa_state is not None:
                    window_keys.append(keys[index])
                    window_runs.append(self._window_run(request, first_page))
            for until, retained_keys in retained.items():
                if self._queued() < MAX_PENDING_WRITES:
                    self.pending_writes.put(_Retain(retained_keys, until))
            request.num_saved_blocks = full
        if window_keys:
            self.swa_state.kept(window_keys, window_runs)

    def _window_run(self, request: Request, first_page: int) -> torch.Tensor:
        """The window group's KV of the block at `first_page`, in host memory: its SWA state. Pages
        the window released read as the null page; no continuation reads those tokens."""
        table = self.block_manager.pages_of(request, 1)[first_page : first_page + self.pages_per_block]
        index = torch.tensor(table, device=self.device)
        run = torch.stack(
            [
                torch.stack([gather_tokens(cache, index, self.block_tokens) for cache in self.kv_cache.layers[layer]])
                for layer in self.window_spec.layers
            ]
        )
        return run.to("cpu", copy=True).contiguous()

    def _queued(self) -> int:
        return self.pending_writes.qsize()

    def _count_stored(self, request: Request, index: int, kept: BlockRetention | None) -> None:
        """A prompt block queued for the store counts for the request's usage (and its hint's)."""
        if (index + 1) * self.block_tokens > len(request.prompt_token_ids):
            return
        request.num_stored_prompt_tokens += self.block_tokens
        if kept is not None:
            by_hint = list(request.stored_tokens_by_hint)
            by_hint[kept.hint] += self.block_tokens
            request.stored_tokens_by_hint = tuple(by_hint)

    def _index_failed(self, error: Exception) -> None:
        """A shared index that does not answer (its server restarting, Redis down) costs hits and
        stored blocks, never a request; said once until it answers again."""
        if not self.index_failing:
            log.warning("the KV store index failed, going on without it: %s", error)
        self.index_failing = True

    def _index_answered(self) -> None:
        if self.index_failing:
            log.info("the KV store index answers again")
        self.index_failing = False

    def _copy_out(
        self, key: BlockHash, index: int, request: Request, first_page: int, num_pages: int, retain_until: float
    ) -> _Write | None:
        """The KV of the request's pages [first_page, first_page + num_pages) (block `index`, or its
        prompt tail) on its way to the host; None when no staging buffer is free."""
        block = self._gather(request.pages[first_page : first_page + num_pages])
        new_chain = request.num_cached_tokens < self.block_tokens
        if self.staging is None:
            host_block = block.to("cpu", copy=True).contiguous()
            return _Write(key, index, request.traffic_class, new_chain, host_block, None, retain_until)
        try:
            buffer = self.staging.get_nowait()
        except queue.Empty:
            return None
        # A prompt tail fills the front of the buffer, contiguous, in its own (shorter) shape.
        staged = buffer.view(-1)[: block.numel()].view(block.shape)
        staged.copy_(block, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _Write(key, index, request.traffic_class, new_chain, staged, copied, retain_until, buffer)

    def stats(self) -> StoreStats:
        return StoreStats(
            num_hit_tokens=self.num_hit_tokens,
            num_blocks_read=self.num_blocks_read,
            num_blocks_written=self.num_blocks_written,
            num_writes_dropped=self.num_writes_dropped,
            num_fetches=self.num_fetches,
            fetch_bytes=self.fetch_bytes,
            fetch_seconds=self.fetch_seconds,
        )

    def close(self) -> None:
        """Finish the queued writes (so a restart finds them) and stop the threads."""
        self.pending_writes.put(None)
        self.writer.join()
        self.readers.shutdown(wait=True, cancel_futures=True)

    def _keys(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first `num_blocks` store keys, extending its cached chain as needed."""
        keys = request.store_keys
        if len(keys) < num_blocks:
            start = len(keys) * self.block_tokens
            tokens = request.token_slice(start, num_blocks * self.block_tokens)
            parent = keys[-1] if keys else ROOT_HASH
            keys.extend(request.block_keys(tokens, self.block_tokens, parent=parent, first_block=len(keys)))
        return keys[:num_blocks]

    def _prompt_tail(self, request: Request) -> tuple[int, int, BlockHash] | None:
        """(index of the block the prompt ends in, tokens of its whole pages, the tail's key); None
        when the prompt ends on a block boundary or inside that block's first page."""
        prompt = len(request.prompt_token_ids)
        index = prompt // self.block_tokens
        start = index * self.block_tokens
        page_size = self.kv_cache.page_size
        tokens = (prompt - start) // page_size * page_size
        if not tokens:
            return None
        parent = self._keys(request, index)[-1] if index else ROOT_HASH
        tail_tokens = request.prompt_token_ids[start : start + tokens]
        return (
            index,
            tokens,
            hash_block(parent, tail_tokens, request.block_extra(index, self.block_tokens) + TAIL_EXTRA),
        )

    def _gather(self, pages: list[int]) -> torch.Tensor:
        """[stored layers, planes, heads, tokens of the pages, width] on the cache's device."""
        index = torch.tensor(pages, device=self.device)
        tokens = len(pages) * self.kv_cache.page_size
        per_layer = [
            torch.stack([gather_tokens(cache, index, tokens) for cache in self.kv_cache.layers[layer]])
            for layer in self.spec.layers
        ]
        return torch.stack(per_layer)

    def _fetch(self, keys: list[BlockHash], first: int, tail: tuple[int, int, BlockHash] | None = None) -> LoadedBlocks:
        """The chain's blocks from `first` on from the store, up to the first missing or bad one; then
        the prompt tail, when every block before it came. A hybrid model's hit also needs the SWA state
        at its end: without it, it backs off one block (the scheduler replays the window before)."""
        started = time.perf_counter()
        blocks = self._read_blocks(keys[first:], self.block_tokens)
        if tail is not None and len(blocks) == len(keys) - first:
            _, tokens, key = tail
            blocks += self._read_blocks([key], tokens)
        seconds = time.perf_counter() - started
        with self.fetch_counts_lock:
            self.num_fetches += 1
            self.fetch_bytes += sum(block.nbytes for block in blocks)
            self.fetch_seconds += seconds
        window_runs = None
        if blocks and len(self.kv_cache.specs.groups) > 1:
            hit = first + len(blocks)
            window_runs = self.swa_state.fetch_window(keys[:hit]) if self.swa_state is not None else None
            if window_runs is None:
                blocks = blocks[:-1]
        num_pages = sum(block.shape[3] for block in blocks) // self.kv_cache.page_size
        return LoadedBlocks(
            first_page=first * self.pages_per_block, num_pages=num_pages, blocks=blocks, window_runs=window_runs
        )

    def _read_blocks(self, keys: list[BlockHash], tokens: int) -> list[torch.Tensor]:
        """Blocks of `tokens` tokens each, up to the first missing or bad one."""
        shape = self.spec.run_shape(tokens)
        expected = self.block_bytes // self.block_tokens * tokens
        blocks: list[torch.Tensor] = []

        def into(size: int) -> memoryview | None:
            """A new block tensor's bytes: each payload is read straight into its block."""
            if size != expected:
                log.warning("store block has %d bytes, expected %d: recomputing from there", size, expected)
                return None
            blocks.append(torch.empty(shape, dtype=self.dtype))
            return memoryview(blocks[-1].view(-1).view(torch.uint8).numpy())

        try:
            payloads = self.store.read(keys, into, layout=self.spec.layout)
        except Exception:
            # An unreachable index or disk costs the hit, never the request.
            log.exception("fetching KV blocks from the store failed; recomputing")
            payloads = []
        # A block whose read failed after its tensor was made is not among the payloads.
        return blocks[: len(payloads)]

    def _write_blocks(self) -> None:
        while (item := self.pending_writes.get()) is not None:
            if isinstance(item, _Retain):
                self._retain(item)
                continue
            if item.copied is not None:
                item.copied.synchronize()
            try:
                data = item.block.view(-1).view(torch.uint8).numpy().data
                written = self.store.write(
                    item.key,
                    data,
                    depth=item.depth,
                    traffic_class=item.traffic_class,
                    retain_until=item.retain_until,
                    new_chain=item.new_chain,
                    layout=self.spec.layout,
                )
                if written:
                    self.num_blocks_written += 1
                    self.swa_stats.store_bytes_not_written += self.window_block_bytes
            except Exception:
                # A full or failing disk, or an unreachable index, costs future hits, never the request
                # (nor the writer thread, which later blocks still need).
                log.exception("writing a KV block to the store failed")
            finally:
                if item.staging is not None:
                    self.staging.put(item.staging)

    def _retain(self, item: _Retain) -> None:
        try:
            self.store.retain(item.keys, item.until)
        except Exception:
            # An unreachable index costs the hint, never the request.
            log.exception("retaining KV blocks in the store failed")
