"""The hit policy of a model with sliding-window layers: how much of a stored prefix a request uses, and
what it replays, given where the SWA state at the prefix end can come from.

The full-attention blocks decide the hit length: the store keeps only those groups' KV, so a prefix
is served up to the first block the store lacks (h = hit blocks × block length). The SWA state decides
whether that hit is used as it is. With the state at h at hand (in this worker's SwaStateCache, or
fetchable from a live worker that holds it), the request starts computing at h and replays nothing.
Without it, the hit backs off one block to h' = h - block and prefill replays the window before h':
the sliding-window layers' KV of those tokens is rebuilt while the full-attention KV of [0, h') still
comes from the store (DESIGN.md, "Sliding windows and bounded replay"):

- "approximate": replay the W tokens before h' (the W - 1 a continuation at h' reads, a window
  counting the query itself, KVCacheSpec.window, and one more, which on small windows halves the
  divergence), with attention truncated to the replayed segment: constant cost, and the KV of the
  first replayed tokens is only approximate, since their own windows are cut short;
- "exact" (for tests): start early enough that every SWA layer's KV of those W - 1 tokens comes out
  as a full prefill would compute it. A layer's KV of a token depends on its input, which each SWA
  layer below has mixed over that token's window, so the j-th SWA layer needs j × (W - 1) tokens of
  replay: the whole replay starts num_swa_layers × (W - 1) before h', or at 0.

A replay that would start at 0 is exact either way.
"""

import enum
from dataclasses import dataclass

APPROXIMATE = "approximate"
EXACT = "exact"
REPLAY_MODES = (APPROXIMATE, EXACT)


class SwaStateSource(enum.Enum):
    """Where the SWA state at a prefix end is: in this worker's cache, with a live worker that holds it
    (a fetch), or nowhere this worker can reach."""

    LOCAL = "local"
    REMOTE = "remote"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class SwaHit:
    hit_tokens: int  # prompt tokens served from the store (whole blocks)
    replay_start: int  # the first token whose SWA KV prefill rebuilds; == hit_tokens: no replay
    # Where the SWA state at hit_tokens comes from: LOCAL or REMOTE (fetch it), or NONE (replayed,
    # or nothing to continue from).
    source: SwaStateSource

    @property
    def replayed_tokens(self) -> int:
        return self.hit_tokens - self.replay_start


def swa_hit(
    hit_blocks: int,
    source: SwaStateSource,
    *,
    block_tokens: int,
    window: int,
    mode: str = APPROXIMATE,
    num_swa_layers: int = 1,
) -> SwaHit:
    """The hit to use for a full-attention hit of `hit_blocks` blocks whose SWA state at its end is at
    `source` (see the module docstring)."""
    if hit_blocks < 0 or block_tokens < 1 or window < 1 or num_swa_layers < 1:
        raise ValueError(
            f"hit_blocks must be >= 0 and block_tokens, window, num_swa_layers positive; got {hit_blocks}, "
            f"{block_tokens}, {window}, {num_swa_layers}"
        )
    if mode not in REPLAY_MODES:
        raise ValueError(f"SWA replay mode must be one of {REPLAY_MODES}, got {mode!r}")
    hit_tokens = hit_blocks * block_tokens
    if hit_blocks == 0 or source is not SwaStateSource.NONE:
        return SwaHit(hit_tokens, hit_tokens, source if hit_blocks else SwaStateSource.NONE)
    backed_off = hit_tokens - block_tokens
    reach = window if mode == APPROXIMATE else num_swa_layers * (window - 1)
    return SwaHit(backed_off, max(0, backed_off - reach), SwaStateSource.NONE)
