"""A speculating request's constraint as the engine holds it (IsolatedConstraint): checking a draft or
computing the masks along it never raises; a constraint that fails there, or gives the wrong number
of masks, allows no draft and every token, and fails its request alone at the next advance."""

import pytest
import torch

from workers.engine.structured.constraint import ConstraintError, IsolatedConstraint

VOCAB = 8


class Digits:
    """Allows tokens 0..4 in turn forever; fails past `fail_after` tokens of a draft."""

    def __init__(self, fail_after: int = 99, masks: int | None = None) -> None:
        self.fail_after = fail_after
        self.masks = masks

    def allowed_tokens(self) -> torch.Tensor:
        return torch.arange(VOCAB) < 5

    def advance(self, token_id: int) -> None:
        pass

    def is_finished(self) -> bool:
        return False

    def valid_prefix(self, token_ids: list[int]) -> int:
        if len(token_ids) > self.fail_after:
            raise ConstraintError("the grammar hit its limit")
        return next((i for i, t in enumerate(token_ids) if t >= 5), len(token_ids))

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        if len(token_ids) > self.fail_after:
            raise ConstraintError("the grammar hit its limit")
        return [self.allowed_tokens()] * (self.masks if self.masks is not None else len(token_ids) + 1)


def test_a_working_constraint_s_draft_answers_pass_through():
    constraint = IsolatedConstraint(Digits(), VOCAB)

    assert constraint.valid_prefix([1, 2, 7, 3]) == 2
    masks = constraint.masks_along([1, 2])
    assert len(masks) == 3 and all(torch.equal(m, torch.arange(VOCAB) < 5) for m in masks)
    constraint.advance(1)


@pytest.mark.parametrize(
    "inner, failure",
    [(Digits(fail_after=1), "hit its limit"), (Digits(masks=1), "2 tokens need 3 masks")],
)
def test_a_failing_draft_check_allows_every_token_and_fails_the_next_advance(inner, failure):
    constraint = IsolatedConstraint(inner, VOCAB)

    masks = constraint.masks_along([1, 2])

    assert len(masks) == 3 and all(bool(m.all()) for m in masks)
    assert constraint.valid_prefix([1]) == 0 and not constraint.is_finished()
    with pytest.raises(Exception, match=failure):
        constraint.advance(1)
