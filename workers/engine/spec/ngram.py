"""Prompt lookup: drafts the tokens that followed the latest earlier occurrence of a request's last
n tokens, trying the longest n first (a longer match predicts its continuation better).

The search reads only the last `lookback` tokens, so a step's work per request is bounded however
long the request grows: O(lookback * max_n) vectorised comparisons, and one copy of the window.
"""

from collections.abc import Sequence

import numpy as np

from workers.engine.request import token_slice
from workers.engine.spec.drafter import NO_DRAFT, Draft, DraftAsk

# One token matches almost anywhere and would draft noise; two already follow a quoted span. The window
# holds a typical quoted prompt.
MAX_NGRAM = 4
MIN_NGRAM = 2
LOOKBACK = 4096


class NgramDrafter:
    def __init__(self, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, lookback: int = LOOKBACK) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"the n-gram sizes must satisfy 1 <= min <= max, got {min_ngram} and {max_ngram}")
        if lookback <= max_ngram:
            raise ValueError(f"lookback ({lookback}) must exceed the largest n-gram ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.lookback = lookback

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        return [self.propose(ask.prompt_token_ids, ask.output_token_ids, ask.max_tokens) for ask in asks]

    def propose(self, prompt_token_ids: list[int], output_token_ids: list[int], max_tokens: int) -> Draft:
        """The tokens after the latest earlier match of the last n tokens; probability 1 each, as the
        proposal is a point mass (a calibrated confidence is the budget's business)."""
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if max_tokens <= 0 or num_tokens <= self.min_ngram:
            return NO_DRAFT
        tail = token_slice(prompt_token_ids, output_token_ids, max(num_tokens - self.lookback, 0), num_tokens)
        window = np.asarray(tail, dtype=np.int64)
        length = len(window)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Candidate starts 0 .. length - n - 1: every earlier n-gram, the suffix itself excluded.
            starts = length - n
            matches = np.ones(starts, dtype=bool)
            for offset in range(n):
                matches &= window[offset : offset + starts] == window[starts + offset]
            found = np.flatnonzero(matches)
            if len(found):
                follow = int(found[-1]) + n
                tokens = window[follow : follow + max_tokens].tolist()
                return Draft(tokens, [1.0] * len(tokens))
        return NO_DRAFT
