"""How many tokens one engine step may compute within its time budget, by the fitted cost model.

A step's predicted time is the model's fixed cost `a` plus each row's marginal cost
`cost(q, c) - a` (q tokens over c already computed). The scheduler asks for each row in turn: a row
of one token (a decode, or the last prompt token) always fits, because holding a stream back costs
more than overrunning the budget by one token; a prefill chunk gets the largest q whose marginal cost
fits what is left, and none once the budget is spent, unless nothing is scheduled yet (a step always
makes progress).
"""

from dataclasses import dataclass

from workers.cost_model import PrefillCostModel


@dataclass(frozen=True, slots=True)
class StepBudget:
    model: PrefillCostModel
    budget_s: float

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise ValueError(f"the step time budget must be positive, got {self.budget_s}")

    def start_step(self) -> "StepTimeLeft":
        return StepTimeLeft(self.model, self.budget_s - self.model.a)


class StepTimeLeft:
    """The part of one step's budget not yet given to rows."""

    def __init__(self, model: PrefillCostModel, left_s: float) -> None:
        self._model = model
        self.left_s = left_s

    def fit(self, count: int, context: int, *, first: bool) -> int:
        """Tokens (at most `count`) of a row over `context` computed tokens that fit; takes their time."""
        if count <= 1:
            granted = count
        elif self.left_s <= 0:
            granted = 1 if first else 0
        else:
            granted = self._model.max_chunk(self.left_s + self._model.a, context, limit=count)
            if not first and self._model.predict(granted, context) - self._model.a > self.left_s:
                granted = 0
        if granted:
            self.left_s -= self._model.predict(granted, context) - self._model.a
        return granted
