"""The drafts each decode step verifies: the engine's drafter asked for at most K tokens per request,
then as many of them as the verification budget gives each (spec.planner), cut by what the request
and the step have room for. After the step, what each request accepted goes back to the planner.

A request with an output constraint drafts only what its grammar allows in turn; the verify step
samples each row under the mask the grammar would give after the drafts before it (the grammar is
rolled back after computing them), and then advances through the emitted tokens only.
"""

from workers.engine.config import EngineConfig
from workers.engine.request import Request
from workers.engine.spec.budget import VALVE_MARGIN
from workers.engine.spec.drafter import NO_DRAFT, Draft, DraftAsk, Drafter
from workers.engine.spec.mtp_drafter import MtpDrafter
from workers.engine.spec.ngram import NgramDrafter
from workers.engine.spec.planner import VerificationPlanner
from workers.engine.spec.stats import SpecDecodeStats
from workers.engine.spec.valve import ThroughputValve


class Speculator:
    def __init__(
        self,
        drafter: Drafter,
        planner: VerificationPlanner,
        *,
        raw_min_confidence: float = 0.0,
        valve: ThroughputValve | None = None,
    ) -> None:
        """`raw_min_confidence`: drafts end before the drafter's own cumulative probability falls
        below it (the fixed budget's use of --spec-min-confidence; dspark applies it to the calibrated
        confidence instead). `valve` (dspark's): turns drafting off for the steps where plain
        decoding measures faster."""
        self.drafter = drafter
        self.planner = planner
        self.valve = valve
        self.max_draft_tokens = planner.max_draft_tokens
        self.raw_min_confidence = raw_min_confidence
        self._planned: list[str] = []  # the request ids of the last plan, in its order

    @property
    def stats(self) -> SpecDecodeStats:
        return self.planner.stats

    @property
    def drafting(self) -> bool:
        """Whether this step drafts (False while the valve's phase is plain)."""
        return self.valve is None or self.valve.drafts

    def record_step(self, seconds: float, num_tokens: int) -> None:
        """A finished step: the time since the previous one finished, and the tokens it emitted."""
        if self.valve is not None:
            self.valve.record(seconds, num_tokens)

    def plan(self, requests: list[Request]) -> dict[str, Draft]:
        """The drafts of the decode steps of `requests` this step may verify, by request id. Never
        more than a request may still emit: a step emits every accepted draft token plus one, and
        must not pass max_tokens (nor, so, the context window). None while not drafting."""
        if not self.drafting:
            return {}
        limits = [min(self.max_draft_tokens, r.max_tokens - len(r.output_token_ids) - 1) for r in requests]
        asks = [DraftAsk(r.request_id, r.prompt_token_ids, r.output_token_ids, n) for r, n in zip(requests, limits)]
        proposed = self.drafter.propose_all(asks)
        drafts = [self._fitted(r, draft, limit) for r, draft, limit in zip(requests, proposed, limits, strict=True)]
        lengths = self.planner.plan(drafts, total_kv=sum(request.num_computed_tokens for request in requests))
        self._planned = [request.request_id for request in requests]
        return {
            request.request_id: draft.prefix(length)
            for request, draft, length in zip(requests, drafts, lengths, strict=True)
        }

    def observe(self, verified: dict[str, int], accepted: dict[str, int]) -> None:
        """After a planned step: the draft tokens each request verified and, of those, accepted (a
        request absent verified none: the step had no room for its drafts, or it left)."""
        if not self._planned:
            return
        planned, self._planned = self._planned, []
        self.planner.observe(
            [verified.get(request_id, 0) for request_id in planned],
            [accepted.get(request_id, 0) for request_id in planned],
        )

    def _fitted(self, request: Request, draft: Draft, limit: int) -> Draft:
        """`draft` cut to `limit` tokens, the drafter's confidence and the request's constraint."""
        if limit <= 0:
            return NO_DRAFT
        draft = draft.cut(limit, self.raw_min_confidence)
        if request.constraint is not None:
            # A draft token the grammar refuses cannot be accepted: the draft ends before it.
            valid = request.constraint.valid_prefix(draft.token_ids)
            draft = draft.prefix(valid)
        return draft


def speculator_for(config: EngineConfig, drafter: Drafter | None = None) -> Speculator | None:
    """The engine's speculator, None without speculation; ValueError naming the setting for a choice
    that cannot run. `drafter`: the draft model's (spec_method 'draft'; workers.engine.builder makes it)."""
    args = config.args
    if args.spec_method == "none":
        return None
    if args.spec_method == "draft" and drafter is None:
        raise ValueError("spec_method 'draft' needs the draft model's drafter (workers.engine.builder builds it)")
    planner = VerificationPlanner(
        args.spec_budget,
        max_draft_tokens=args.spec_max_draft_tokens,
        min_confidence=args.spec_min_confidence if args.spec_budget == "dspark" else 0.0,
        cost_model=config.cost_model,
        stats=SpecDecodeStats(args.spec_method, args.spec_max_draft_tokens),
    )
    if args.spec_method == "mtp":
        drafter = MtpDrafter()  # fed by the model runner's MTP pass
    raw_min_confidence = args.spec_min_confidence if args.spec_budget == "fixed" else 0.0
    valve = ThroughputValve(margin=VALVE_MARGIN) if args.spec_budget == "dspark" else None
    return Speculator(drafter or NgramDrafter(), planner, raw_min_confidence=raw_min_confidence, valve=valve)
