"""How the scheduler gives drafts to decode steps: within the step's tokens and the request's
max_tokens, with pages for them, never for a prefill, and for a constrained request only what its
constraint allows."""

from workers.engine.kv.block_manager import BlockManager
from workers.engine.request import Request
from workers.engine.sched.scheduler import Scheduler
from workers.engine.spec.ngram import NgramDrafter
from workers.engine.spec.planner import VerificationPlanner
from workers.engine.spec.speculator import Speculator
from workers.engine.spec.stats import SpecDecodeStats
from workers.protocol.sampling_params import SamplingParams

# Decoding it after [1..8] * 2 drafts 1, 2, 3, ... (what followed the earlier 7, 8).
QUOTED = list(range(1, 9)) * 2


def decoding(request_id: str, max_tokens: int = 64, output: int = 1) -> Request:
    """A request whose first `output` tokens are sampled: once all but the last are computed
    (scheduler_with), its next step is a decode."""
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(QUOTED),
        params=SamplingParams(),
        max_tokens=max_tokens,
        hash_extra=b"m",
        output_token_ids=list(range(1, output + 1)),
    )
    return request


def scheduler_with(*requests: Request, budget: int = 64, pages: int = 64, k: int = 5) -> Scheduler:
    manager = BlockManager(num_pages=pages, page_size=4)
    planner = VerificationPlanner(
        "fixed", max_draft_tokens=k, min_confidence=0.0, cost_model=None, stats=SpecDecodeStats("ngram", k)
    )
    speculator = Speculator(NgramDrafter(), planner)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=budget, speculator=speculator)
    for request in requests:
        assert manager.allocate(request, request.num_tokens - 1)
        request.num_computed_tokens = request.num_tokens - 1
        scheduler.add_running(request)
    return scheduler


def test_a_decode_verifies_up_to_k_drafts_with_pages_for_them():
    request = decoding("a")
    scheduler = scheduler_with(request)

    output = scheduler.schedule()

    assert output.draft_token_ids == {"a": [2, 3, 4, 5, 6]}
    assert output.num_scheduled_tokens == [6] and output.sample == [True]
    # 17 tokens plus 5 drafts: six pages of four.
    assert len(request.pages) == 6


def test_drafts_fit_the_step_budget_and_the_tokens_left_to_emit():
    long_lived, ending = decoding("a"), decoding("b", max_tokens=4, output=1)
    scheduler = scheduler_with(long_lived, ending, budget=6)

    output = scheduler.schedule()

    # "a" takes 1 + 4 drafts of the 6 tokens, leaving "b" its own token (and no room to draft).
    assert output.draft_token_ids == {"a": [2, 3, 4, 5]}
    assert output.num_scheduled_tokens == [5, 1]
    assert output.sample == [True, True]

    # "c" may emit 3 more tokens: its own and 2 accepted drafts.
    scheduler = scheduler_with(decoding("c", max_tokens=4, output=1))
    assert scheduler.schedule().draft_token_ids == {"c": [2, 3]}


class AllowsBelow:
    """A constraint that allows the tokens below `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def valid_prefix(self, token_ids: list[int]) -> int:
        return next((i for i, token in enumerate(token_ids) if token >= self.limit), len(token_ids))


def test_a_request_at_its_last_token_drafts_nothing_and_a_constrained_one_what_its_constraint_allows():
    last = decoding("a", max_tokens=2, output=1)
    constrained = decoding("b")
    constrained.constraint = AllowsBelow(4)
    scheduler = scheduler_with(last, constrained)

    output = scheduler.schedule()

    assert output.draft_token_ids == {"b": [2, 3]}
    assert output.num_scheduled_tokens == [1, 3]


def test_finish_step_keys_only_pages_of_known_tokens():
    request = decoding("a")
    scheduler = scheduler_with(request)
    output = scheduler.schedule()

    scheduler.finish_step(output, {"a": request})

    # 17 known tokens: four full pages are keyed; the page where the drafts' KV lies is not.
    assert request.num_computed_tokens == 17 + 5
    assert len(request.page_hashes) == 4
