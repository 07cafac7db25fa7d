"""The engine's KV cache: the block manager (which pages a request holds, the prefix cache), the
device cache those pages index, copying tokens in and out of pages, and sizing the cache from the
device's memory."""
