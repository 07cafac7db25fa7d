"""Drafts from DeepSeek-V3's multi-token-prediction layer (--spec-method mtp). The model runner runs
the layer after each step (runner.mtp_pass), from the main model's final hidden states, and hands
the engine each sampling request's chained greedy draft; a step's plan proposes what its request was
last given, each token with the probability the layer's softmax gave it."""

from collections.abc import Sequence

from workers.engine.spec.drafter import NO_DRAFT, Draft, DraftAsk


class MtpDrafter:
    def __init__(self) -> None:
        self._drafts: dict[str, Draft] = {}  # by request id: what the last step drafted after its token

    def receive(self, drafts: dict[str, Draft]) -> None:
        """A step's drafts, in place of the last step's: a request that did not sample in it (it left,
        or waits) drafts nothing next."""
        self._drafts = drafts

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Draft]:
        proposed = []
        for ask in asks:
            draft = self._drafts.pop(ask.request_id, NO_DRAFT)
            proposed.append(draft.prefix(ask.max_tokens))
        return proposed
