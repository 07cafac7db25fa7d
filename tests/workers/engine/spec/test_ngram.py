"""The n-gram (prompt lookup) drafter and the cutting of drafts."""

import random

import pytest

from workers.engine.spec.drafter import Draft, DraftAsk
from workers.engine.spec.ngram import NgramDrafter


def test_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_matching_suffix():
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    # [7, 8, 9] occurred at 0 (then 1, 2) and at 5 (then 3, 4): the later one wins.
    tokens = [7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9]
    assert drafter.propose(tokens[:10], tokens[10:], 3) == Draft([3, 4, 5], [1.0, 1.0, 1.0])


def test_a_longer_match_beats_a_later_shorter_one():
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    # The suffix [5, 8, 9]: its 3-gram occurs at 0 (then 1); only the 2-gram [8, 9] occurs later (then 2).
    tokens = [5, 8, 9, 1, 0, 8, 9, 2, 5, 8, 9]
    assert drafter.propose(tokens, [], 1).token_ids == [1]


def test_no_match_or_no_room_drafts_nothing():
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    assert drafter.propose([1, 2, 3, 4, 5], [6], 4).token_ids == []
    assert drafter.propose([1, 2, 1, 2], [], 0).token_ids == []


def test_the_draft_stops_at_the_end_of_the_history():
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    # The latest earlier [1, 2] is followed by [3, 1, 2] only.
    assert drafter.propose([1, 2, 3, 1, 2], [], 5).token_ids == [3, 1, 2]


def test_only_the_lookback_window_is_searched():
    far = [4, 5, 6] + [0] * 20
    assert NgramDrafter(max_ngram=2, min_ngram=2, lookback=10).propose(far, [4, 5], 1).token_ids == []
    assert NgramDrafter(max_ngram=2, min_ngram=2, lookback=30).propose(far, [4, 5], 1).token_ids == [6]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="lookback"):
        NgramDrafter(max_ngram=4, lookback=4)


def test_cut_keeps_tokens_while_the_cumulative_probability_holds():
    draft = Draft([1, 2, 3, 4], [0.9, 0.8, 0.9, 0.5])
    assert draft.cut(4, 0.0).token_ids == [1, 2, 3, 4]
    assert draft.cut(2, 0.0).token_ids == [1, 2]
    # Cumulative: 0.9, 0.72, 0.648, 0.324.
    assert draft.cut(4, 0.7) == Draft([1, 2], [0.9, 0.8])
    assert draft.cut(4, 0.95).token_ids == []


@pytest.mark.parametrize("lookback", [5, 9, 4096])
def test_windows_kept_between_steps_draft_what_a_fresh_search_drafts(lookback):
    # Requests grow by a few tokens a step, some skip steps, one's history is replaced (a request
    # resumed elsewhere under its id): the kept windows, compacted past 2 * lookback, stay exact.
    rng = random.Random(lookback)
    kept, fresh = NgramDrafter(lookback=lookback), NgramDrafter(lookback=lookback)
    requests = {str(i): ([rng.randrange(4) for _ in range(rng.randrange(1, 12))], []) for i in range(6)}
    for _ in range(60):
        asks = [DraftAsk(i, prompt, output, 3) for i, (prompt, output) in requests.items() if rng.random() < 0.8]
        expected = [fresh.propose(ask.prompt_token_ids, ask.output_token_ids, 3) for ask in asks]
        assert kept.propose_all(asks) == expected
        for _, output in requests.values():
            output.extend(rng.randrange(4) for _ in range(rng.randrange(4)))
        if rng.random() < 0.1:
            requests[rng.choice(list(requests))] = ([rng.randrange(4) for _ in range(5)], [])
