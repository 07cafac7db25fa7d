"""Owns the KV pages: allocation, reference counts, and the engine-local prefix cache.

Pages are allocated per KV group (workers.engine.kv.spec): the first group's pages are the request's
`pages`, which the prefix cache keys; every further group has a pool and a page table per request of
its own, in which a sliding-window group gives back the pages that fell out of its window (NULL_PAGE
takes their place). Every model today has one group.

A full page is keyed by the chained block hash of its tokens (workers.kvstore.block_hash), so a prompt's
cached prefix is found by walking its chain. A freed page keeps its key until it is handed out
again, so the prefix stays reusable as long as memory allows. Free pages form one LRU list in
which keyless pages are reused first, then keyed pages oldest first.
"""

from collections import OrderedDict, deque
from collections.abc import Sequence

from kernels.attention import NULL_PAGE
from workers.engine.request import Request
from workers.kvstore.block_hash import ROOT_HASH, BlockHash, hash_block, hash_chain, reusable_blocks


class GroupPages:
    """The pages of a KV group after the first: a pool of `num_pages` and each request's page table."""

    def __init__(self, num_pages: int, window: int | None) -> None:
        self.window = window  # tokens a query reads (None: all of them)
        self.free_pages: deque[int] = deque(page for page in range(num_pages) if page != NULL_PAGE)
        self.tables: dict[str, list[int]] = {}

    def release_out_of_window(self, request: Request, page_size: int) -> None:
        """Give back the request's pages wholly before the first token its next query reads."""
        if self.window is None:
            return
        table = self.tables.get(request.request_id, [])
        first_read = max(request.num_computed_tokens - self.window + 1, 0)
        for index in range(min(first_read // page_size, len(table))):
            if table[index] != NULL_PAGE:
                self.free_pages.append(table[index])
                table[index] = NULL_PAGE

    def take(self, request: Request, count: int) -> None:
        table = self.tables.setdefault(request.request_id, [])
        table.extend(self.free_pages.popleft() for _ in range(max(count, 0)))

    def free(self, request: Request) -> None:
        self.free_pages.extend(page for page in self.tables.pop(request.request_id, ()) if page != NULL_PAGE)


class BlockManager:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        """`windows`: per KV group (KVCacheSpecs.windows), the tokens a query reads, None for all; the
        first group's is None (its pages are the ones the prefix cache keys). Each group has
        `num_pages` pages."""
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is reserved), got {num_pages}")
        if not windows or windows[0] is not None:
            raise ValueError(f"the first KV group keeps every token's page, got windows {tuple(windows)}")
        self.num_pages = num_pages
        self.page_size = page_size
        # The prefix cache keys the first group's pages only: a hit would lack the other groups' KV.
        self.enable_prefix_caching = enable_prefix_caching and len(windows) == 1
        self.groups = [GroupPages(num_pages, window) for window in windows[1:]]
        self.ref_counts = [0] * num_pages
        self.page_keys: list[BlockHash | None] = [None] * num_pages
        # The tokens behind each key: a hit is also compared token by token (collision guard).
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.cached_pages: dict[BlockHash, int] = {}
        # An OrderedDict is an O(1) doubly-linked list in C: pop from the front, remove from the middle.
        self.free_pages: OrderedDict[int, None] = OrderedDict(
            (page, None) for page in range(num_pages) if page != NULL_PAGE
        )

    @property
    def num_free_pages(self) -> int:
        """Of the group with the fewest."""
        return min([len(self.free_pages), *(len(group.free_pages) for group in self.groups)])

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[int], list[BlockHash]]:
        """Pages (and their keys) holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute, since the next token is sampled from the
        last token's logits; so a prompt of whole pages can hit all but its last page.
        """
        if not self.enable_prefix_caching:
            return [], []
        tokens = request.all_token_ids
        max_blocks = reusable_blocks(len(tokens), self.page_size)
        keys = hash_chain(tokens, self.page_size, request.hash_extra, max_blocks=max_blocks)
        pages: list[int] = []
        for i, key in enumerate(keys):
            page = self.cached_pages.get(key)
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            if page is None or self.page_tokens[page] != chunk:
                break
            pages.append(page)
        return pages, keys[: len(pages)]

    def pages_of(self, request: Request, group: int) -> list[int]:
        """The request's pages in KV group `group`, in token order."""
        return request.pages if group == 0 else self.groups[group - 1].tables.get(request.request_id, [])

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: tuple[list[int], list[BlockHash]] = ([], []),
        *,
        lookahead: int = 0,
    ) -> bool:
        """Give the request pages, in every KV group, for `num_new_tokens` more tokens and `lookahead`
        slots past them (room for speculative tokens), first attaching `cached` pages.

        All or nothing: False (nothing changed) when there are not enough free pages, which the
        scheduler answers with preemption.
        """
        hit_pages, hit_keys = cached
        total = request.num_computed_tokens + len(hit_pages) * self.page_size + num_new_tokens + lookahead
        for group in self.groups:
            group.release_out_of_window(request, self.page_size)
        if not hit_pages and total <= len(request.pages) * self.page_size:
            return True  # the common decode step: its token fits the last page
        needed = self.pages_needed(total) - len(request.pages) - len(hit_pages)
        hits_now_free = sum(1 for page in hit_pages if self.ref_counts[page] == 0)
        if needed > len(self.free_pages) - hits_now_free:
            return False
        group_needs = [
            self.pages_needed(total) - len(group.tables.get(request.request_id, ())) for group in self.groups
        ]
        if any(need > len(group.free_pages) for group, need in zip(self.groups, group_needs)):
            return False
        for group, need in zip(self.groups, group_needs):
            group.take(request, need)
        for page in hit_pages:
            if self.ref_counts[page] == 0:
                del self.free_pages[page]
            self.ref_counts[page] += 1
        request.pages.extend(hit_pages)
        request.page_hashes.extend(hit_keys)
        for _ in range(max(needed, 0)):
            page, _ = self.free_pages.popitem(last=False)
            self._forget_key(page)
            self.ref_counts[page] = 1
            request.pages.append(page)
        return True

    def cache_full_pages(self, request: Request) -> None:
        """Key the request's pages that became full of computed tokens, extending its chain."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens, request.num_known_tokens) // self.page_size
        if full <= len(request.page_hashes):
            return
        tokens = request.all_token_ids
        for index in range(len(request.page_hashes), full):
            chunk = tuple(tokens[index * self.page_size : (index + 1) * self.page_size])
            parent = request.page_hashes[-1] if request.page_hashes else ROOT_HASH
            key = hash_block(parent, chunk, request.hash_extra)
            request.page_hashes.append(key)
            page = request.pages[index]
            # Another request may have computed the same prefix in the same step: keep the first copy.
            if key not in self.cached_pages and self.page_keys[page] is None:
                self.cached_pages[key] = page
                self.page_keys[page] = key
                self.page_tokens[page] = chunk

    def free(self, request: Request) -> None:
        """Drop the request's references; pages nobody uses become free but keep their keys.

        Pages are released tail first, so a chain's later pages are reused before its head, which
        more requests share.
        """
        for page in reversed(request.pages):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages[page] = None
                if self.page_keys[page] is None:
                    self.free_pages.move_to_end(page, last=False)
        request.pages = []
        for group in self.groups:
            group.free(request)

    def _forget_key(self, page: int) -> None:
        key = self.page_keys[page]
        if key is not None:
            if self.cached_pages.get(key) == page:
                del self.cached_pages[key]
            self.page_keys[page] = None
            self.page_tokens[page] = None
