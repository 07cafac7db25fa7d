"""How long a split request's prefill path may take before it is given up on, from its predicted
prefill time, so that a long prompt is never abandoned (and computed again) while it is still being
computed.

    prefill_s  = predicted compute of the prompt's uncached tokens, chunked by the step budget
                 + predicted compute of the prefills this gateway queued ahead of it on that worker
    margin     = DEADLINE_FACTOR * (1 + the prefill worker's recent p90 prediction error)
    first output (the prefill's first token)  within  DEADLINE_SLACK_S + margin * prefill_s
    transfer     (then the decode's first output) within  TRANSFER_SLACK_S + margin * own prefill
    handoff      (the decode worker's wait for the KV, from the expectation): both of the above

Predictions come from a cost model fitted on this hardware (SLUICE_COST_MODEL); without one, from
CONSERVATIVE_PREFILL_S_PER_TOKEN. The nominal model the router falls back to only weighs workers
against each other (ratios), which is why it never sets a deadline. The queue ahead is charged as if
it were one prompt of all its tokens: the quadratic terms make that the larger prediction.
"""

from dataclasses import dataclass

from workers.client.routing.router import CHUNK_LIMIT, STEP_BUDGET_S
from workers.cost_model import PrefillCostModel

DEADLINE_FACTOR = 2.0
DEADLINE_SLACK_S = 30.0  # scheduling, queueing behind other gateways' requests, a loaded host
# Sending the KV, writing it into pages and one decode step: far less than computing it, and
# growing with the same tokens.
TRANSFER_SLACK_S = 30.0
# Without a fitted model: seconds per uncached prompt token, well above SmolLM2-135M fp32 on a
# 2-core CPU (about 15 ms per token of an 8,000-token prompt, the slowest case measured).
CONSERVATIVE_PREFILL_S_PER_TOKEN = 0.05


@dataclass(frozen=True, slots=True)
class PrefillDeadlines:
    """Seconds, each counted from when its wait starts."""

    first_output_s: float  # from sending the request to the prefill worker until its first output
    transfer_s: float  # from the prefill's first output until the decode worker's first output

    @property
    def handoff_s(self) -> float:
        """The decode worker's wait for the KV, counted from the expectation (sent with the request)."""
        return self.first_output_s + self.transfer_s


@dataclass(frozen=True, slots=True)
class DeadlineModel:
    cost_model: PrefillCostModel | None  # fitted on this hardware; None: the conservative rate
    step_budget_s: float = STEP_BUDGET_S
    chunk_limit: int = CHUNK_LIMIT

    def predicted_s(self, tokens: int, cached: int = 0) -> float:
        """Predicted seconds to compute `tokens - cached` prompt tokens after `cached` cached ones."""
        if tokens <= cached:
            return 0.0
        if self.cost_model is None:
            return (tokens - cached) * CONSERVATIVE_PREFILL_S_PER_TOKEN
        return self.cost_model.predict_prefill(tokens, cached, self.step_budget_s, limit=self.chunk_limit)

    def deadlines(
        self, *, prompt_tokens: int, cached_tokens: int, queued_tokens: int, prediction_error: float
    ) -> PrefillDeadlines:
        """`queued_tokens`: uncached tokens of the prefills queued ahead on the worker;
        `prediction_error`: its heartbeat's recent p90 relative error of the cost model (0 without one)."""
        own_s = self.predicted_s(prompt_tokens, cached_tokens)
        margin = DEADLINE_FACTOR * (1.0 + max(prediction_error, 0.0))
        return PrefillDeadlines(
            first_output_s=DEADLINE_SLACK_S + margin * (own_s + self.predicted_s(queued_tokens)),
            transfer_s=TRANSFER_SLACK_S + margin * own_s,
        )
