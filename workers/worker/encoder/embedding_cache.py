"""The encode worker's embedding cache: images' embeddings by content hash (workers.text.image_hash),
bounded in bytes, the least recently used evicted first. An image seen before is never encoded again
while its embeddings are here. Used by the serving thread alone; the heartbeat thread only reads its
counters."""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One image's embeddings: a C-ordered `shape` array of `dtype` (a torch dtype name), as raw bytes."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


class EmbeddingCache:
    def __init__(self, capacity_bytes: int) -> None:
        """`capacity_bytes` 0: nothing is kept (every lookup misses)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, Embeddings] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: bytes) -> Embeddings | None:
        """The image's embeddings, now the most recently used; counted as a hit or a miss."""
        found = self._entries.get(content_hash)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(content_hash)
        return found

    def put(self, content_hash: bytes, embeddings: Embeddings) -> None:
        """Keep the image's embeddings, evicting the least recently used until they fit; embeddings
        larger than the whole cache are not kept."""
        size = len(embeddings.data)
        if size > self.capacity_bytes:
            return
        previous = self._entries.pop(content_hash, None)
        if previous is not None:
            self.num_bytes -= len(previous.data)
        while self.num_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= len(evicted.data)
        self._entries[content_hash] = embeddings
        self.num_bytes += size
