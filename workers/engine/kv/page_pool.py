"""One KV group's pages: reference counts, the keys of pages that hold a cached block, and the free list.

A full page is keyed by the chained block hash of its tokens (workers.kvstore.block_hash). A freed page
keeps its key until it is handed out again, so its block stays reusable as long as memory allows.
Free pages form one LRU list in which keyless pages are reused first, then keyed pages oldest first.
"""

from collections import OrderedDict

from kernels.attention import NULL_PAGE
from workers.kvstore.block_hash import BlockHash


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
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
    def num_free(self) -> int:
        return len(self.free_pages)

    def cached(self, key: BlockHash, tokens: tuple[int, ...]) -> int | None:
        """The page holding the block of this key and these tokens, if any (held or free)."""
        page = self.cached_pages.get(key)
        return page if page is not None and self.page_tokens[page] == tokens else None

    def take(self) -> int:
        """A free page, no longer keyed, referenced once."""
        page, _ = self.free_pages.popitem(last=False)
        self._forget_key(page)
        self.ref_counts[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more reference to a cached page (taken off the free list if nobody held it)."""
        if self.ref_counts[page] == 0:
            del self.free_pages[page]
        self.ref_counts[page] += 1

    def release(self, page: int) -> None:
        """One reference fewer; a page nobody holds becomes free, keeping its key (a keyless one is
        reused first)."""
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages[page] = None
            if self.page_keys[page] is None:
                self.free_pages.move_to_end(page, last=False)

    def key(self, page: int, key: BlockHash, tokens: tuple[int, ...]) -> None:
        """Key a page that became full. Another request may have computed the same block in the same
        step: the first copy keeps the key."""
        if key not in self.cached_pages and self.page_keys[page] is None:
            self.cached_pages[key] = page
            self.page_keys[page] = key
            self.page_tokens[page] = tokens

    def _forget_key(self, page: int) -> None:
        key = self.page_keys[page]
        if key is not None:
            if self.cached_pages.get(key) == page:
                del self.cached_pages[key]
            self.page_keys[page] = None
            self.page_tokens[page] = None
