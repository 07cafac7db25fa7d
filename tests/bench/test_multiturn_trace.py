from collections import Counter
from dataclasses import replace

import pytest

from bench.multiturn_trace import BLOCK_TOKENS, SHAPES, MultiTurnConfig, generate

SMALL = MultiTurnConfig(sessions=200, seed=5, min_system_tokens=1200, max_system_tokens=3000, system_prompts=3)


def test_one_off_questions_share_a_system_prompt_and_end_in_blocks_of_their_own():
    # Given only one-off sessions, all of them questions under the shared prompts (at least 2 blocks)
    trace = generate(replace(SMALL, one_off_share=0.99, one_off_shared_share=0.99, continue_prob=0.0))

    # Then every request opens with blocks other requests share, and its blocks past them are its own
    uses = Counter(block_id for request in trace for block_id in request["hash_ids"])
    for request in trace:
        full = request["input_length"] // BLOCK_TOKENS
        assert uses[request["hash_ids"][0]] > 1
        shared = sum(uses[block_id] > 1 for block_id in request["hash_ids"][:full])
        assert shared >= 2
        assert all(uses[block_id] == 1 for block_id in request["hash_ids"][shared:])


def test_shapes_without_questions_keep_their_traces():
    # The question draw happens only when asked for, so a seed's trace is the same as before it existed.
    assert generate(replace(SMALL, one_off_share=0.3)) == generate(replace(SMALL, one_off_share=0.3))
    assert generate(replace(SMALL, one_off_share=0.3, one_off_shared_share=0.5)) != generate(
        replace(SMALL, one_off_share=0.3)
    )
    assert SHAPES["api"].one_off_shared_share > 0


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_one_off_shared_share_is_validated(share):
    with pytest.raises(ValueError, match="one_off_shared_share must be in"):
        replace(SMALL, one_off_shared_share=share).validate()
