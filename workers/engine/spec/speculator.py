"""The drafts each decode step verifies: the engine's drafter, asked for at most K tokens (fixed
budget), cut by --spec-min-confidence and by what the request and the step have room for.

Requests with an output constraint never draft: verifying a draft would advance the grammar through
tokens that may be rejected, and its state has no rollback here yet.
"""

from workers.args import EngineArgs
from workers.engine.request import Request
from workers.engine.spec.drafter import NO_DRAFT, Draft, Drafter
from workers.engine.spec.ngram import NgramDrafter


class Speculator:
    def __init__(self, drafter: Drafter, *, max_draft_tokens: int, min_confidence: float) -> None:
        self.drafter = drafter
        self.max_draft_tokens = max_draft_tokens
        self.min_confidence = min_confidence

    def draft(self, request: Request, room: int) -> Draft:
        """The draft a decode step of `request` verifies, at most `room` tokens (what the step's token
        budget leaves). Never more than the request may still emit: the step emits every accepted
        draft token plus one, and must not pass max_tokens (nor, so, the context window)."""
        limit = min(self.max_draft_tokens, room, request.max_tokens - len(request.output_token_ids) - 1)
        if limit <= 0 or request.constraint is not None:
            return NO_DRAFT
        draft = self.drafter.propose(request.prompt_token_ids, request.output_token_ids, limit)
        return draft.cut(limit, self.min_confidence)


def speculator_for(args: EngineArgs) -> Speculator | None:
    """The engine's speculator, None without speculation; ValueError naming the setting for a choice
    not built yet."""
    if args.spec_budget != "fixed":
        raise ValueError(
            f"spec_budget {args.spec_budget!r} is not available yet; use 'fixed' (every draft up to "
            "spec_max_draft_tokens is verified)"
        )
    if args.spec_method == "none":
        return None
    if args.spec_method != "ngram":
        raise ValueError(f"spec_method {args.spec_method!r} is not available yet; use 'ngram' or 'none'")
    return Speculator(
        NgramDrafter(), max_draft_tokens=args.spec_max_draft_tokens, min_confidence=args.spec_min_confidence
    )
