"""The entrypoint: what the data plane decides about a request before any worker sees it."""
