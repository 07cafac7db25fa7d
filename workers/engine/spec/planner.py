"""How much of one step's drafts is verified (--spec-budget), and what the outcomes teach.

Each step: the drafts' probabilities, calibrated per draft position by what was accepted before
(confidence.AcceptanceCalibrator), become each draft prefix's expected accepted length; the budget
(budget.SpecBudget) sets the step's total of draft tokens, `fixed` every draft, `dspark` the total
that maximises expected tokens per second on the step-time curve of the fitted cost model, judged on
the previous step's expectations (lagged, as under async scheduling), and splits it among requests
by greedy marginal allocation. After verification, what each request accepted updates the
calibration, and the counters (stats.SpecDecodeStats) count the step.

On the reference path this all runs on the host's tensors.
"""

import numpy as np
import torch

from workers.cost_model import PrefillCostModel
from workers.engine.spec.budget import VerifyStepCurve, make_spec_budget
from workers.engine.spec.confidence import NO_DRAFT, AcceptanceCalibrator, expected_accepted_prefix
from workers.engine.spec.drafter import Draft
from workers.engine.spec.stats import SpecDecodeStats

# Steps between refreshes of the calibration error the counters report (it reads the calibrator back).
CALIBRATION_ERROR_EVERY = 64


class VerificationPlanner:
    def __init__(
        self,
        budget: str,
        *,
        max_draft_tokens: int,
        min_confidence: float,
        cost_model: PrefillCostModel | None,
        stats: SpecDecodeStats,
    ) -> None:
        if budget == "dspark" and cost_model is None:
            raise ValueError("spec_budget 'dspark' needs cost_model: its total comes from the fitted step-time curve")
        self.budget = make_spec_budget(budget, max_draft_tokens=max_draft_tokens, min_confidence=min_confidence)
        self.calibrator = AcceptanceCalibrator(max_draft_tokens)
        self.cost_model = cost_model
        self.max_draft_tokens = max_draft_tokens
        self.stats = stats
        self._lagged: np.ndarray | None = None  # the previous step's expected accepted prefixes
        self._planned: torch.Tensor | None = None  # the last plan's raw probabilities
        self._steps = 0

    def plan(self, drafts: list[Draft], total_kv: int) -> list[int]:
        """How many of its drafts each request verifies this step (a prefix of each)."""
        # Filled as a host array, then wrapped: a small tensor op per request costs more than its row.
        probs = np.full((len(drafts), self.max_draft_tokens), NO_DRAFT, dtype=np.float32)
        for row, draft in enumerate(drafts):
            if draft.probs:
                probs[row, : len(draft)] = draft.probs[: self.max_draft_tokens]
        raw = torch.from_numpy(probs)
        expected = expected_accepted_prefix(self.calibrator.calibrate(raw))
        curve = (
            VerifyStepCurve.from_cost_model(self.cost_model, batch=len(drafts), total_kv=total_kv)
            if self.cost_model is not None
            else None
        )
        total = self.budget.plan_total(batch=len(drafts), step_seconds=curve, lagged_prefix=self._lagged)
        lengths = self.budget.allocate(expected, total)
        self._lagged = expected.numpy()
        self._planned = raw
        return lengths.tolist()

    def observe(self, verified: list[int], accepted: list[int]) -> None:
        """The draft tokens each request of the last plan verified and, of those, accepted, in its order."""
        raw = self._planned
        self._planned = None
        self.calibrator.observe(
            raw, torch.tensor(verified, dtype=torch.int64), torch.tensor(accepted, dtype=torch.int64)
        )
        self.stats.record_step(verified, accepted)
        self._steps += 1
        if self._steps % CALIBRATION_ERROR_EVERY == 0:
            self.stats.calibration_error = self.calibrator.calibration_error().overall
