"""Routing: what the gateway decides about a request before any worker sees it (its cached prefix, the
prefill and decode workers that take it)."""
