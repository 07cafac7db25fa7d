"""The engine's KV cache: the specs of its groups of layers (what each keeps per token, and so every
size and layout), the block manager (which pages a request holds, the prefix cache), the device cache
those pages index, copying tokens in and out of pages, and sizing the cache from the device's memory."""
