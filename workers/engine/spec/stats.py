"""Counters of an engine's speculative decoding since it started, vLLM's spec_decode metrics' values:
drafts verified, their tokens, the tokens accepted, and how many were accepted at each draft position."""


class SpecStats:
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position")

    def __init__(self, max_draft_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Entry i: drafts whose token i was accepted (so every token before it too).
        self.accepted_per_position = [0] * max_draft_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One draft of `num_draft_tokens` tokens verified, its first `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step emits per request on average: the accepted drafts plus the one the
        target samples after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
