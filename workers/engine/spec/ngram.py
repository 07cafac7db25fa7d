"""Prompt lookup: drafts the tokens that followed the latest earlier occurrence of a request's last
n tokens, trying the longest n first (a longer match predicts its continuation better).

The search reads only the last `lookback` tokens, so a step's work per request is bounded however
long the request grows: max_n vectorised comparisons over the window, and one copy of it.
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
        self._windows: dict[str, _Window] = {}  # by request id, of the last step's requests

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        """Each request's window is kept between steps and extended by its new tokens: converting a
        long token list anew each step costs more than the search. Only the requests of this step
        keep theirs."""
        windows = {}
        drafts = []
        for ask in asks:
            window = self._extended(self._windows.get(ask.request_id), ask.prompt_token_ids, ask.output_token_ids)
            windows[ask.request_id] = window
            drafts.append(self._search(window.tokens(), ask.max_tokens))
        self._windows = windows
        return drafts

    def propose(self, prompt_token_ids: list[int], output_token_ids: list[int], max_tokens: int) -> Draft:
        """The tokens after the latest earlier match of the last n tokens; probability 1 each, as the
        proposal is a point mass (a calibrated confidence is the budget's business)."""
        return self._search(_Window.of(prompt_token_ids, output_token_ids, self.lookback).tokens(), max_tokens)

    def _extended(self, window: "_Window | None", prompt: list[int], output: list[int]) -> "_Window":
        """`window` with the request's tokens past it, or a new one where the request's tokens are no
        longer an extension of it (its history changed, as after a resumption elsewhere)."""
        num_tokens = len(prompt) + len(output)
        if window is None or not window.extends_to(prompt, output):
            return _Window.of(prompt, output, self.lookback)
        window.append(token_slice(prompt, output, window.length, num_tokens))
        return window

    def _search(self, window: np.ndarray, max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(window) <= self.min_ngram:
            return NO_DRAFT
        length = len(window)
        largest = min(self.max_ngram, length - 1)
        # Position k (0 .. length - 2) is a candidate continuation start k + 1, the suffix's own
        # excluded. An n-gram ends before it where the n tokens before k + 1 equal the last n: each
        # longer n ands in one more comparison, token i before both ends.
        agree = np.ones(length - 1, dtype=bool)
        matches = []
        for i in range(largest):
            agree[:i] = False
            agree[i:] &= window[: length - 1 - i] == window[length - 1 - i]
            matches.append(agree.copy() if i + 1 < largest else agree)
        for n in range(largest, self.min_ngram - 1, -1):
            found = np.flatnonzero(matches[n - 1])
            if len(found):
                follow = int(found[-1]) + 1
                tokens = window[follow : follow + max_tokens].tolist()
                return Draft(tokens, [1.0] * len(tokens))
        return NO_DRAFT


class _Window:
    """The last tokens of a request (at least `lookback` of them, at most twice that) as an array,
    so a step appends only its new ones; `length` counts all the request's tokens."""

    def __init__(self, tokens: np.ndarray, length: int, lookback: int) -> None:
        self._buffer = tokens  # the request's tokens from position length - len(tokens) on
        self._used = len(tokens)
        self.length = length
        self.lookback = lookback

    @classmethod
    def of(cls, prompt: list[int], output: list[int], lookback: int) -> "_Window":
        length = len(prompt) + len(output)
        tail = token_slice(prompt, output, max(length - lookback, 0), length)
        return cls(np.asarray(tail, dtype=np.int64), length, lookback)

    def extends_to(self, prompt: list[int], output: list[int]) -> bool:
        """Whether the request's tokens are these followed by more (or none): the count has not
        shrunk and the last one kept is still the request's."""
        if self._used == 0 or len(prompt) + len(output) < self.length:
            return False
        last = self.length - 1
        token = prompt[last] if last < len(prompt) else output[last - len(prompt)]
        return int(self._buffer[self._used - 1]) == token

    def append(self, tokens: list[int]) -> None:
        used = self._used + len(tokens)
        if used > len(self._buffer):
            # Keep the last lookback tokens, in a buffer with room for as many again.
            kept = self._buffer[max(self._used - self.lookback, 0) : self._used]
            grown = np.empty(max(2 * self.lookback, len(kept) + len(tokens)), dtype=np.int64)
            grown[: len(kept)] = kept
            self._buffer, self._used = grown, len(kept)
            used = self._used + len(tokens)
        self._buffer[self._used : used] = tokens
        self._used = used
        self.length += len(tokens)

    def tokens(self) -> np.ndarray:
        """The last `lookback` tokens (a view)."""
        return self._buffer[max(self._used - self.lookback, 0) : self._used]
