"""Which samples a verifying sequence emits, found with tensor ops (no host sync), against the rule
written as a loop: a sequence emits its samples up to and including the first that differs from its
draft, and its last sample (after its last draft) always ends it."""

import random

import torch

from workers.engine.runner.verify import accept_on_device


def emitted_by_loop(tokens: list[int], drafts: list[list[int]]) -> list[list[int]]:
    emitted, index = [], 0
    for sequence_drafts in drafts:
        samples = tokens[index : index + len(sequence_drafts) + 1]
        accepted = 0
        while accepted < len(sequence_drafts) and samples[accepted] == sequence_drafts[accepted]:
            accepted += 1
        emitted.append(samples[: accepted + 1])
        index += len(sequence_drafts) + 1
    return emitted


def test_each_sequence_emits_its_samples_up_to_its_first_rejected_draft():
    rng = random.Random(0)
    for _ in range(200):
        drafts = [[rng.randrange(3) for _ in range(rng.randrange(6))] for _ in range(rng.randrange(1, 9))]
        tokens = [rng.randrange(3) for sequence in drafts for _ in range(len(sequence) + 1)]
        draft_ids = [d for sequence in drafts for d in sequence + [-1]]
        first = [sum(len(s) + 1 for s in drafts[:i]) for i, s in enumerate(drafts) for _ in range(len(s) + 1)]

        masked, ends = accept_on_device(torch.tensor(tokens), torch.tensor(draft_ids), torch.tensor(first))

        expected = emitted_by_loop(tokens, drafts)
        assert [t for t in masked.tolist() if t >= 0] == [t for sequence in expected for t in sequence]
        ended = [tokens[i] for i in ends.nonzero().flatten().tolist()]
        assert ended == [sequence[-1] for sequence in expected]  # one end per sequence, its last emitted


def test_a_draft_equal_to_a_sample_of_another_sequence_is_not_accepted_across_sequences():
    # Sequence 0 rejects its only draft; sequence 1's samples all match: its prefix must not be cut by
    # sequence 0's rejection, nor extended past its own last sample.
    tokens = torch.tensor([9, 4, 5, 6, 7])
    draft_ids = torch.tensor([3, -1, 5, 6, -1])
    first = torch.tensor([0, 0, 2, 2, 2])

    masked, ends = accept_on_device(tokens, draft_ids, first)

    assert masked.tolist() == [9, -1, 5, 6, 7]
    assert ends.tolist() == [True, False, False, False, True]
