"""What a drafter is, and the drafts one step verifies.

A drafter proposes, for one request, up to k tokens that may follow its tokens so far, each with the
drafter's probability of that token. Verification (workers.engine.runner.verify) treats every draft
as a point mass: the drafter chose its tokens deterministically, whatever probability it reports. The
probabilities are confidences, for cutting drafts short (--spec-min-confidence) and for a budget that
weighs them; they do not enter acceptance.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True, slots=True)
class Draft:
    token_ids: list[int]
    probs: list[float]  # per token, the drafter's probability that it follows the ones before it

    def __len__(self) -> int:
        return len(self.token_ids)

    def cut(self, max_tokens: int, min_confidence: float) -> "Draft":
        """At most `max_tokens` tokens, ending before the first whose cumulative probability (the chance
        that it and every token before it are accepted) falls below `min_confidence`."""
        keep = 0
        confidence = 1.0
        for prob in self.probs[:max_tokens]:
            confidence *= prob
            if confidence < min_confidence:
                break
            keep += 1
        return self.prefix(keep)

    def prefix(self, length: int) -> "Draft":
        """Its first `length` tokens."""
        return Draft(self.token_ids[:length], self.probs[:length])


NO_DRAFT = Draft([], [])


class DraftAsk(NamedTuple):
    """A request's tokens so far (its own lists: read, never written), and the most tokens to draft."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    max_tokens: int


class Drafter(Protocol):
    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        """For each request of a step, in order, up to its `max_tokens` tokens likely to follow its
        tokens so far (all at once: a model drafts them as one batch)."""
        ...
