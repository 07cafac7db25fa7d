import numpy as np

from bench.serve.prefix_reuse import ideal_hit_rate


def prompt(*blocks, tail=0):
    """Blocks of 4 tokens named by a letter, then `tail` tokens of their own."""
    tokens = [ord(name) * 10 + offset for name in blocks for offset in range(4)]
    return np.array(tokens + [9000 + offset for offset in range(tail)])


def test_ideal_hit_rate_on_a_hand_made_trace():
    prompts = [
        prompt("A", "B", tail=2),  # 10 tokens, nothing seen: 0
        prompt("A", "B", "C", tail=1),  # 13 tokens, A B seen: 8
        prompt("A", "C", tail=1),  # 9 tokens: A hits; C was seen only after A B, not right after A: 4
        prompt("A", "B", "C"),  # 12 tokens, all seen, but the last block holds the last token: 8
        prompt("B", "A"),  # 8 tokens: B first was never seen: 0
    ]

    assert ideal_hit_rate(prompts, block_size=4) == (0 + 8 + 4 + 8 + 0) / (10 + 13 + 9 + 12 + 8)


def test_a_coarser_block_hits_only_whole_blocks():
    prompts = [prompt("A", "B", "C", tail=1), prompt("A", "B", "D", tail=1)]

    # In blocks of 8 tokens, the shared 8 tokens (A B) are one block: the second prompt hits it.
    assert ideal_hit_rate(prompts, block_size=8) == 8 / 26
    # In blocks of 16, no prompt has a whole block before its last token.
    assert ideal_hit_rate(prompts, block_size=16) == 0.0


def test_no_prompts_have_no_rate():
    assert ideal_hit_rate([], block_size=16) is None
