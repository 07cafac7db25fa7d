"""The engine's KV connectors: where a request's KV comes from and where it goes (the global block
store; the prefill→decode handoff, of which a migration is one more case)."""
