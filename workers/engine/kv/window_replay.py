"""Bounded replay of a hybrid model's sliding windows after a prefix hit.

A hit of h tokens gives the full-attention layers their KV before h, but a sliding-window layer's query
at h also reads the window's last tokens before h, whose KV may no longer be held (released pages reused,
or a hit from the global store, which keeps the full group only). Instead of giving up the hit, the
request recomputes a bounded segment [s, h) before it: its full-attention layers read their cached
pages as they are and write nothing (their slots there are -1: a shared, keyed page is never
rewritten), its window layers write the segment's KV into fresh pages and attend only within the
segment (each query at i reads keys max(s, i - window + 1)..i: the attention metadata's per-sequence
"first readable key", 0 otherwise). Then the request goes on from h as usual.

- approximate: s = h - window (the widest window; the span the entrypoint's hit policy counts too,
  kvstore.swa_replay): the W - 1 tokens the query at h reads besides itself, and one before them, which on
  tiny windows halves the replay's divergence (tests/workers/engine/test_window_replay.py). Each window
  layer's KV of the segment is computed from a context cut at s, so the window before h approximates
  the one a full computation would give;
  the KV the request computes from then on is approximate too, so it is never keyed for reuse nor
  stored (Request.num_reusable_tokens).
- exact: s early enough that the cut never reaches the window before h: a window layer's KV at i is
  exact once its input is, which at the k-th window layer from the bottom holds for i >= s +
  (k - 1)(window - 1) (full-attention layers read exact cached keys and add no reach), so
  s = h - (window layers) × (window - 1) rebuilds the window exactly, for the price of a longer replay.

A store hit replays only when the SWA state at its end cannot be had (kv.swa_state: kept by the worker
that computed it, fetched from it by others): it then backs off one block first (DESIGN.md, "Sliding
windows and bounded replay"; connectors.store). With the state, its runs fill fresh window pages and
nothing is replayed.
"""

from dataclasses import dataclass

from workers.args import SWA_REPLAYS
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.request import WindowReplay


@dataclass(frozen=True, slots=True)
class ReplayPolicy:
    mode: str  # one of workers.args.SWA_REPLAYS
    span: int  # tokens before the hit a replay recomputes (fewer at the start of the context)

    @classmethod
    def of(cls, specs: KVCacheSpecs, mode: str) -> "ReplayPolicy | None":
        """The policy for a cache's windows; None for a cache without window groups."""
        if mode not in SWA_REPLAYS:
            raise ValueError(f"unknown swa_replay {mode!r}; choose from {list(SWA_REPLAYS)}")
        windows = [group for group in specs.groups if group.window is not None]
        if not windows:
            return None
        widest = max(group.window for group in windows)
        if mode == "approximate":
            return cls(mode, widest)
        return cls(mode, sum(len(group.layers) for group in windows) * (widest - 1))

    def replay(self, hit_tokens: int) -> WindowReplay:
        return WindowReplay(start=max(hit_tokens - self.span, 0), end=hit_tokens, exact=self.mode == "exact")
