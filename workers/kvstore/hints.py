"""Which store blocks a request's cache hints keep, and for how long (workers.protocol.messages.CacheHint).

A hint covers the prompt's first `prefix_tokens` tokens; the store keeps whole blocks, so a hint
keeps the blocks that lie wholly inside its prefix. Hints are prefixes of one prompt, so the blocks
they cover are always the leading ones, and a block inside several prefixes is kept under the hint
that keeps it longest: with Anthropic's rule that 1h breakpoints come before 5m ones, the blocks up
to a 1h breakpoint are kept for an hour and those between it and a later 5m breakpoint for five
minutes.

Hints are a tenant's requests, so the worker caps them (RetentionCaps, from the engine settings
kv_store_max_retained_tokens and kv_store_max_retention_s): one request keeps at most that many
leading prompt tokens for at most that long, however many hints it sends. A cap of 0 turns hints off.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from workers.protocol.messages import CacheHint


@dataclass(frozen=True, slots=True)
class RetentionCaps:
    max_tokens: int  # leading prompt tokens one request may have retained
    max_retention_s: float  # the longest one hint may retain them

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or not self.max_retention_s >= 0:
            raise ValueError(f"retention caps must be >= 0, got {self.max_tokens} tokens, {self.max_retention_s} s")


@dataclass(frozen=True, slots=True)
class BlockRetention:
    """How one leading block of a prompt is kept."""

    hint: int  # the index of the hint it is kept under
    seconds: float


def plan_retention(hints: Sequence[CacheHint], block_tokens: int, caps: RetentionCaps) -> tuple[BlockRetention, ...]:
    """One entry per leading block that a hint covers, within the caps; () without hints."""
    if not hints or caps.max_retention_s == 0:
        return ()
    covered = min(max(hint.prefix_tokens for hint in hints), caps.max_tokens)
    plan = []
    for block in range(covered // block_tokens):
        end = (block + 1) * block_tokens
        # The longest retention among the hints whose prefix holds the whole block; the first on ties.
        seconds, index = max((hint.retain_s, -index) for index, hint in enumerate(hints) if hint.prefix_tokens >= end)
        plan.append(BlockRetention(hint=-index, seconds=min(seconds, caps.max_retention_s)))
    return tuple(plan)
