"""Which leading store blocks a request's cache hints keep, under which hint, and for how long."""

import pytest

from workers.kvstore.hints import BlockRetention, RetentionCaps, plan_retention
from workers.protocol.messages import CacheHint

BLOCK = 32
NO_CAPS = RetentionCaps(max_tokens=1 << 20, max_retention_s=1e9)


def test_a_hint_keeps_the_blocks_wholly_inside_its_prefix() -> None:
    plan = plan_retention([CacheHint(prefix_tokens=100, retain_s=300)], BLOCK, NO_CAPS)

    assert plan == (BlockRetention(0, 300),) * 3  # 96 tokens; the block of tokens 96-127 is not all inside


def test_a_block_inside_several_prefixes_is_kept_under_the_longest_retention() -> None:
    # Anthropic's order: the 1h breakpoint comes first, a 5m one after it.
    hints = [CacheHint(prefix_tokens=70, retain_s=3600), CacheHint(prefix_tokens=150, retain_s=300)]

    plan = plan_retention(hints, BLOCK, NO_CAPS)

    assert plan == (BlockRetention(0, 3600),) * 2 + (BlockRetention(1, 300),) * 2


def test_equal_retentions_keep_a_block_under_the_first_hint() -> None:
    hints = [CacheHint(prefix_tokens=64, retain_s=300), CacheHint(prefix_tokens=64, retain_s=300)]

    assert plan_retention(hints, BLOCK, NO_CAPS) == (BlockRetention(0, 300),) * 2


def test_the_caps_bound_the_tokens_and_the_seconds_but_not_which_hint_a_block_is_under() -> None:
    hints = [CacheHint(prefix_tokens=200, retain_s=86400), CacheHint(prefix_tokens=40, retain_s=300)]

    plan = plan_retention(hints, BLOCK, RetentionCaps(max_tokens=100, max_retention_s=3600))

    assert plan == (BlockRetention(0, 3600),) * 3


@pytest.mark.parametrize(
    ("hints", "caps"),
    [
        ([], NO_CAPS),
        ([CacheHint(prefix_tokens=31, retain_s=300)], NO_CAPS),
        ([CacheHint(prefix_tokens=200, retain_s=300)], RetentionCaps(max_tokens=0, max_retention_s=3600)),
        ([CacheHint(prefix_tokens=200, retain_s=300)], RetentionCaps(max_tokens=1000, max_retention_s=0)),
    ],
    ids=["no-hints", "shorter-than-a-block", "no-tokens-allowed", "no-seconds-allowed"],
)
def test_nothing_is_kept(hints, caps) -> None:
    assert plan_retention(hints, BLOCK, caps) == ()


def test_negative_caps_are_refused() -> None:
    with pytest.raises(ValueError, match="retention caps"):
        RetentionCaps(max_tokens=-1, max_retention_s=10)
