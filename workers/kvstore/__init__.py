"""The global KV block store: block files on a directory, an index of them, TTL and watermark GC."""
