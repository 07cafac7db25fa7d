"""Owns the KV pages: allocation, reference counts, and the engine-local prefix cache.

Pages are allocated per KV group (workers.engine.kv.spec), each from a pool of its own
(workers.engine.kv.page_pool). The first group keeps every token: its pages are the request's `pages`,
which the prefix cache keys. Every further group is a sliding window with a page table per request,
indexed by token position like `pages`: the pages that fell out of its window go back to its pool
(NULL_PAGE takes their place), so a long request holds at most ceil(window / page_size) + 1 of them
between steps, plus those of the chunk it computes.

A full page is keyed by the chained block hash of its tokens (workers.kvstore.block_hash), so a prompt's
cached prefix is found by walking its chain. A window group's full pages are keyed by the same hashes
while the request holds them, and keep their keys once freed, like the first group's. A hit of h tokens
needs, in each window group, the pages of the tokens the query at position h reads. The hit is the
longest prefix of the first group's chain whose window pages are all still cached, unless a replay
policy (kv.window_replay) lets a longer one be taken: one page short of the first group's whole hit,
its window's KV recomputed by a bounded replay, when that recomputes less than the shorter hit would.
A hit with store blocks loaded past it always replays (the store keeps no window's KV).
"""

from collections.abc import Sequence

from kernels.attention import NULL_PAGE
from workers.engine.kv.kv_cache import per_group
from workers.engine.kv.page_pool import PagePool
from workers.engine.kv.window_replay import ReplayPolicy
from workers.engine.request import Request, WindowReplay
from workers.kvstore.block_hash import ROOT_HASH, BlockHash, hash_block, reusable_blocks

# In a page table being built: a page to take from the pool.
FRESH_PAGE = -1


class BlockManager:
    def __init__(
        self,
        *,
        num_pages: int | Sequence[int],
        page_size: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
        replay: ReplayPolicy | None = None,
    ) -> None:
        """`windows`: per KV group (KVCacheSpecs.windows), the tokens a query reads, None for all; the
        first group's is None (its pages are the ones the prefix cache keys), every other one's a
        window. `num_pages`: of every group, or per group. `replay`: how a hit whose window pages are
        not all cached is replayed; None: such hits are not taken (the attention backend cannot)."""
        if not windows or windows[0] is not None or any(window is None for window in windows[1:]):
            raise ValueError(f"the first KV group keeps every token's page, the others slide, got {tuple(windows)}")
        self.pools = [PagePool(count) for count in per_group(num_pages, len(windows))]
        self.windows = tuple(windows)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.replay = replay if len(windows) > 1 else None
        # Per window group, each request's page table, and how many of its leading entries were released.
        self.tables: list[dict[str, list[int]]] = [{} for _ in windows[1:]]
        self.num_released: list[dict[str, int]] = [{} for _ in windows[1:]]
        # The first group's pool, which the prefix cache and the store key, under its own names.
        first = self.pools[0]
        self.num_pages = first.num_pages
        self.ref_counts, self.page_keys, self.page_tokens = first.ref_counts, first.page_keys, first.page_tokens
        self.cached_pages, self.free_pages = first.cached_pages, first.free_pages

    @property
    def num_free_pages(self) -> int:
        """Of the first group: the tokens the cache can still take."""
        return self.pools[0].num_free

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def usage(self) -> float:
        """Of the fullest group."""
        return max(1.0 - pool.num_free / (pool.num_pages - 1) for pool in self.pools)

    @property
    def widest_window(self) -> int:
        """Tokens the widest window group's query reads, itself included (a model with windows)."""
        return max(window for window in self.windows if window is not None)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[int], list[BlockHash]]:
        """Pages (and their keys) holding the longest cached prefix of the request's tokens whose window
        pages, in every window group, are cached too, or a longer one to replay (see the module
        docstring and replay_for_hit).

        At least one token is always left to compute, since the next token is sampled from the
        last token's logits; so a prompt of whole pages can hit all but its last page.
        """
        if not self.enable_prefix_caching:
            return [], []
        tokens = request.all_token_ids
        max_blocks = reusable_blocks(len(tokens), self.page_size)
        keys = request.block_keys(tokens, self.page_size, max_blocks=max_blocks)
        pages: list[int] = []
        for i, key in enumerate(keys):
            page = self.pools[0].cached(key, self._chunk(tokens, i))
            if page is None:
                break
            pages.append(page)
        found = list(pages)
        while pages and not self._windows_cached(tokens, keys, len(pages)):
            pages.pop()
        # One page back, replayed: worth it when the replay starts past the hit whose windows are cached.
        replayed = len(found) - 1
        if self.replay is not None and replayed * self.page_size - self.replay.span > len(pages) * self.page_size:
            pages = found[:replayed]
        return pages, keys[: len(pages)]

    def _windows_cached(self, tokens: list[int], keys: list[BlockHash], num_pages: int) -> bool:
        return all(self._window_hits(g, tokens, keys, num_pages) is not None for g in range(1, len(self.pools)))

    def replay_for_hit(
        self, request: Request, cached: tuple[list[int], list[BlockHash]], num_loaded_tokens: int = 0
    ) -> WindowReplay | None:
        """The window replay a hit of the `cached` pages, and `num_loaded_tokens` loaded from the store
        after them, needs; None when it needs none (or none can be run: allocate then refuses it)."""
        pages, keys = cached
        hit_tokens = len(pages) * self.page_size + num_loaded_tokens
        if self.replay is None or not hit_tokens:
            return None
        if not num_loaded_tokens and self._windows_cached(request.all_token_ids, keys, len(pages)):
            return None
        return self.replay.replay(hit_tokens)

    def _chunk(self, tokens: list[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[index * self.page_size : (index + 1) * self.page_size])

    def _window_hits(self, group: int, tokens: list[int], keys: list[BlockHash], num_pages: int) -> list[int] | None:
        """Window group `group`'s page table for a hit of `num_pages` pages: NULL_PAGE before the window
        the next query reads, its cached pages in it; None when one of those is not cached."""
        first_read = max(num_pages * self.page_size - self.windows[group] + 1, 0)
        table = [NULL_PAGE] * num_pages
        for index in range(first_read // self.page_size, num_pages):
            page = self.pools[group].cached(keys[index], self._chunk(tokens, index))
            if page is None:
                return None
            table[index] = page
        return table

    def pages_of(self, request: Request, group: int) -> list[int]:
        """The request's pages in KV group `group`, in token order (NULL_PAGE where a window released one)."""
        return request.pages if group == 0 else self.tables[group - 1].get(request.request_id, [])

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: tuple[list[int], list[BlockHash]] = ([], []),
        *,
        lookahead: int = 0,
        window_start: int | None = None,
    ) -> bool:
        """Give the request pages, in every KV group, for `num_new_tokens` more tokens and `lookahead`
        slots past them (room for speculative tokens), first attaching `cached` pages (found by
        find_cached_prefix) with their window pages; or, from `window_start` on (a replay's start,
        or the window a handed-over request's KV fills), fresh window pages, and none before.

        All or nothing: False (nothing changed) when a group has not enough free pages, which the
        scheduler answers with preemption, or when a window page of a hit without replay was reused
        since it was found (the request is admitted in a later step).
        """
        hit_pages, hit_keys = cached
        total = request.num_computed_tokens + len(hit_pages) * self.page_size + num_new_tokens + lookahead
        self._release_out_of_window(request)
        if not hit_pages and total <= len(request.pages) * self.page_size:
            return True  # the common decode step: its token fits the last page
        needed = self.pages_needed(total) - len(request.pages) - len(hit_pages)
        fresh = [FRESH_PAGE] * max(needed, 0)
        additions = [hit_pages + fresh]
        for group in range(1, len(self.pools)):
            if window_start is not None:
                first = min(window_start // self.page_size, len(hit_pages) + len(fresh))
                additions.append([NULL_PAGE] * first + [FRESH_PAGE] * (len(hit_pages) + len(fresh) - first))
            elif hit_pages:
                window_pages = self._window_hits(group, request.all_token_ids, hit_keys, len(hit_pages))
                if window_pages is None:
                    return False
                additions.append(window_pages + fresh)
            else:
                additions.append(fresh)
        for pool, added in zip(self.pools, additions):
            hits_now_free = sum(1 for page in added if page > NULL_PAGE and pool.ref_counts[page] == 0)
            if added.count(FRESH_PAGE) > pool.num_free - hits_now_free:
                return False
        request.page_hashes.extend(hit_keys)
        for group, (pool, added) in enumerate(zip(self.pools, additions)):
            for page in added:
                if page > NULL_PAGE:
                    pool.share(page)
            pages = request.pages if group == 0 else self.tables[group - 1].setdefault(request.request_id, [])
            pages.extend(pool.take() if page == FRESH_PAGE else page for page in added)
        return True

    def _release_out_of_window(self, request: Request) -> None:
        """Give back the request's window pages wholly before the first token its next query reads."""
        for group in range(1, len(self.pools)):
            table = self.tables[group - 1].get(request.request_id)
            if not table:
                continue
            first_read = max(request.num_computed_tokens - self.windows[group] + 1, 0)
            released = self.num_released[group - 1]
            start = released.get(request.request_id, 0)
            stop = min(first_read // self.page_size, len(table))
            for index in range(start, stop):
                if table[index] != NULL_PAGE:
                    self.pools[group].release(table[index])
                    table[index] = NULL_PAGE
            released[request.request_id] = max(start, stop)

    def cache_full_pages(self, request: Request) -> None:
        """Key the request's pages that became full of computed tokens, extending its chain, in the
        first group and in each window group where the request still holds the page."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_reusable_tokens, request.num_known_tokens) // self.page_size
        if full <= len(request.page_hashes):
            return
        tokens = request.all_token_ids
        for index in range(len(request.page_hashes), full):
            chunk = self._chunk(tokens, index)
            parent = request.page_hashes[-1] if request.page_hashes else ROOT_HASH
            key = hash_block(parent, chunk, request.block_extra(index, self.page_size))
            request.page_hashes.append(key)
            for group, pool in enumerate(self.pools):
                page = self.pages_of(request, group)[index]
                if page != NULL_PAGE:
                    pool.key(page, key, chunk)

    def free(self, request: Request) -> None:
        """Drop the request's references; pages nobody uses become free but keep their keys.

        Pages are released tail first, so a chain's later pages are reused before its head, which
        more requests share.
        """
        for page in reversed(request.pages):
            self.pools[0].release(page)
        request.pages = []
        for group in range(1, len(self.pools)):
            self.num_released[group - 1].pop(request.request_id, None)
            for page in reversed(self.tables[group - 1].pop(request.request_id, [])):
                if page != NULL_PAGE:
                    self.pools[group].release(page)
