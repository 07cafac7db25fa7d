"""How much of one step's drafts is verified (--spec-budget), and what the outcomes teach.

Each step: the drafts' probabilities, calibrated per draft position by what was accepted before
(confidence.AcceptanceCalibrator), become each draft prefix's expected accepted length; the budget
(budget.SpecBudget) sets the step's total of draft tokens, `fixed` every draft, `dspark` the total
that maximises expected tokens per second on the step-time curve of the fitted cost model, judged on
the previous step's expectations (lagged, as under async scheduling), and splits it among requests
by greedy marginal allocation. After verification, what each request accepted updates the
calibration, and the counters (stats.SpecDecodeStats) count the step.

On the reference path this all runs on the host's tensors.

What it costs per step matters: a verify step waits for the host (no async overlap), so every
millisecond here is a millisecond of the step. `fixed` plans from which drafts exist alone and hands
its outcomes to the calibrator every OBSERVE_EVERY steps in one call (its calibration feeds only the
reported error); `dspark` calibrates and learns every step, scoring outcomes with the calibrated
probabilities its plan computed rather than computing them again.
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
# Steps whose outcomes the fixed budget gathers before the calibrator learns them, in one call: the
# outcomes of a batch are decayed together rather than in order, a difference of under 16 steps'
# outcomes in a memory of thousands.
OBSERVE_EVERY = 16


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
        self.calibrates_each_step = budget == "dspark"
        self._lagged: np.ndarray | None = None  # the previous step's expected accepted prefixes
        # The last plan's raw probabilities, and calibrated ones where it computed them.
        self._planned: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._unobserved: list[tuple[torch.Tensor, list[int], list[int]]] = []  # gathered by fixed
        self._steps = 0

    def plan(self, drafts: list[Draft], total_kv: int) -> list[int]:
        """How many of its drafts each request verifies this step (a prefix of each)."""
        # Filled as a host array, then wrapped: a small tensor op per request costs more than its row.
        probs = np.full((len(drafts), self.max_draft_tokens), NO_DRAFT, dtype=np.float32)
        for row, draft in enumerate(drafts):
            if draft.probs:
                probs[row, : len(draft)] = draft.probs[: self.max_draft_tokens]
        raw = torch.from_numpy(probs)
        if not self.calibrates_each_step:
            # Which drafts exist is all the fixed budget reads: the raw matrix marks them.
            self._planned = (raw, None)
            total = self.budget.plan_total(batch=len(drafts), step_seconds=None, lagged_prefix=None)
            return self.budget.allocate(raw, total).tolist()
        calibrated = self.calibrator.calibrate(raw)
        expected = expected_accepted_prefix(calibrated)
        curve = (
            VerifyStepCurve.from_cost_model(self.cost_model, batch=len(drafts), total_kv=total_kv)
            if self.cost_model is not None
            else None
        )
        total = self.budget.plan_total(batch=len(drafts), step_seconds=curve, lagged_prefix=self._lagged)
        lengths = self.budget.allocate(expected, total)
        self._lagged = expected.numpy()
        self._planned = (raw, calibrated)
        return lengths.tolist()

    def observe(self, verified: list[int], accepted: list[int]) -> None:
        """The draft tokens each request of the last plan verified and, of those, accepted, in its order."""
        raw, calibrated = self._planned
        self._planned = None
        self.stats.record_step(verified, accepted)
        self._steps += 1
        if calibrated is not None:
            self.calibrator.observe(
                raw,
                torch.tensor(verified, dtype=torch.int64),
                torch.tensor(accepted, dtype=torch.int64),
                calibrated=calibrated,
            )
        else:
            self._unobserved.append((raw, verified, accepted))
            if len(self._unobserved) >= OBSERVE_EVERY or self._steps % CALIBRATION_ERROR_EVERY == 0:
                self._observe_gathered()
        if self._steps % CALIBRATION_ERROR_EVERY == 0:
            self.stats.calibration_error = self.calibrator.calibration_error().overall

    def _observe_gathered(self) -> None:
        gathered, self._unobserved = self._unobserved, []
        self.calibrator.observe(
            torch.cat([raw for raw, _, _ in gathered]),
            torch.tensor([v for _, verified, _ in gathered for v in verified], dtype=torch.int64),
            torch.tensor([a for _, _, accepted in gathered for a in accepted], dtype=torch.int64),
        )
