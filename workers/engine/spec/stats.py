"""What speculative decoding did since the engine started, for the worker's heartbeats: per request
that verified drafts in a step, how many draft tokens it verified and how many of them were
accepted (and so at which draft positions), and per verify step the budget: the draft tokens the
whole batch verified.

Counted as vLLM counts: a "draft" is one request's drafts verified in one step, so the mean accepted
length (tokens a request gains per verifying step, the bonus token included) is
1 + accepted tokens / drafts.
"""

from collections.abc import Sequence

from workers.engine.step_stats import Buckets

# Draft tokens a step verifies over its batch: 0 when the budget turned speculation off for a step.
SPEC_BUDGET_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class SpecDecodeStats:
    def __init__(self, method: str, max_draft_tokens: int) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be at least 1, got {max_draft_tokens}")
        self.method = method
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * max_draft_tokens
        self.budget = Buckets(SPEC_BUDGET_BOUNDS)
        # The drafter's confidence against what was accepted lately (expected calibration error);
        # 0 until a calibrated budget reports one.
        self.calibration_error = 0.0

    def record_step(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """One verify step: per request of its batch, the draft tokens it verified and, of those, how
        many were accepted (a prefix of them)."""
        max_draft_tokens = len(self.accepted_per_position)
        for num_verified, num_accepted in zip(verified, accepted, strict=True):
            if not 0 <= num_accepted <= num_verified <= max_draft_tokens:
                raise ValueError(
                    f"a request verifies 0..{max_draft_tokens} draft tokens and accepts at most those, "
                    f"got {num_accepted} accepted of {num_verified}"
                )
            if not num_verified:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += num_verified
            self.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                self.accepted_per_position[position] += 1
        self.budget.observe(sum(verified))
