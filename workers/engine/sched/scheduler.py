"""Continuous batching with chunked prefill, prefix hits and preemption by recompute.

Each step the scheduler decides how many tokens every request computes, within a token budget:
running requests first, in arrival order (a decode costs one token, an unfinished prefill
continues with the next chunk), then waiting requests, whose cached prefix pages are attached
first (except for a request that reports prompt logprobs: every prompt position must produce
logits). When pages run out, the most recently admitted running request is preempted: its pages
are freed and it goes back to the front of the queue to be recomputed later. The scheduler moves
request objects and lists of ints; it never touches tensors.
"""

from collections import deque
from dataclasses import dataclass, field

from workers.block_hash import BlockHash
from workers.engine.block_manager import BlockManager
from workers.engine.constraints import TokenConstraint
from workers.engine.request import Request, RequestStatus
from workers.engine.sampling_params import SamplingParams
from workers.engine.sched.step_budget import StepBudget
from workers.engine.store_connector import KVLoad, LoadedBlocks


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: what the model runner needs and nothing else."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # position of token_ids[0] (= tokens already computed)
    block_table: list[int]  # the request's pages, in order
    sample: bool  # this step reaches the last known token: sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    constraint: TokenConstraint | None  # masks the sampled token
    # Top alternatives to report for the prompt tokens this step computes, when the request asked
    # for prompt logprobs and they are not yet reported; else None.
    prompt_logprobs: int | None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]
    # Store blocks to copy into pages before the step runs (requests admitted with a store hit).
    loads: list[KVLoad] = field(default_factory=list)
    # Requests that left the scheduler (finished, aborted, handed off) since the last scheduled step:
    # the model runner drops their rows.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_budget: StepBudget | None = None,
    ) -> None:
        """`step_budget`, when given, also caps each step by predicted time (see step_budget)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_budget = step_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_admitted_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0  # of the admitted prompt tokens, those hit in the prefix cache
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        time_left = self.step_budget.start_step() if self.step_budget is not None else None
        plan: list[tuple[Request, int]] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if count and time_left is not None:
                count = time_left.fit(count, request.num_computed_tokens, first=not plan)
            if not count:
                # Nothing to compute: with async scheduling, a request whose last sampled token is
                # still on its way (and ends it) waits for it.
                index += 1
                continue
            if self._allocate_or_preempt(request, count, preempted):
                plan.append((request, count))
                budget -= count
                index += 1

        # Admitting while preempting would only evict what was just admitted. A request whose store
        # blocks are still being fetched keeps its place; those behind it may go first.
        loads: list[KVLoad] = []
        position = 0
        while not preempted and position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[position]
            if request.is_fetching:
                position += 1
                continue
            cached = ([], []) if request.needs_prompt_logits else self.block_manager.find_cached_prefix(request)
            cached, loaded = self._with_fetched_blocks(request, cached)
            page_size = self.block_manager.page_size
            cached_tokens = len(cached[0]) * page_size
            loaded_tokens = loaded.num_pages * page_size if loaded else 0
            count = min(request.num_tokens - cached_tokens - loaded_tokens, budget)
            if time_left is not None:
                count = time_left.fit(count, cached_tokens + loaded_tokens, first=not plan)
                if not count:
                    break
            if not self.block_manager.allocate(request, loaded_tokens + count, cached):
                break
            del self.waiting[position]
            request.store_fetch = None
            if loaded:
                first = loaded.first_page
                loads.append(KVLoad(pages=request.pages[first : first + loaded.num_pages], blocks=loaded.blocks))
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached_tokens + loaded_tokens
                self.num_admitted_prompt_tokens += len(request.prompt_token_ids)
                self.num_cached_prompt_tokens += cached_tokens + loaded_tokens
            request.num_computed_tokens = cached_tokens + loaded_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.append((request, count))
            budget -= count

        finished, self._finished_ids = (self._finished_ids, []) if plan else ([], self._finished_ids)
        return SchedulerOutput(
            scheduled=[self._describe(r, n) for r, n in plan],
            preempted=preempted,
            loads=loads,
            finished_request_ids=finished,
        )

    @staticmethod
    def _with_fetched_blocks(
        request: Request, cached: tuple[list[int], list[BlockHash]]
    ) -> tuple[tuple[list[int], list[BlockHash]], LoadedBlocks | None]:
        """The cached pages to attach and the store blocks to load after them, if they extend the
        prefix: fetched blocks start at a block boundary, so local pages past it are dropped."""
        loaded = request.store_fetch.result() if request.store_fetch is not None else None
        if loaded is None or not loaded.num_pages:
            return cached, None
        pages, keys = cached
        if len(pages) < loaded.first_page or len(pages) >= loaded.first_page + loaded.num_pages:
            return cached, None
        return (pages[: loaded.first_page], keys[: loaded.first_page]), loaded

    def _allocate_or_preempt(self, request: Request, count: int, preempted: list[str]) -> bool:
        """Allocate for `request`, preempting from the back of the running list until it fits.

        False when `request` itself had to be preempted.
        """
        while not self.block_manager.allocate(request, count):
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
            preempted.append(victim.request_id)
            self.num_preemptions += 1
            if victim is request:
                return False
        return True

    def _describe(self, request: Request, count: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + count),
            start_position=start,
            block_table=request.pages,
            sample=start + count == request.num_tokens,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            constraint=request.constraint,
            prompt_logprobs=request.prompt_logprobs if request.needs_prompt_logits else None,
        )

    def finish_step(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Advance computed-token counts and key the pages that became full."""
        for scheduled in output.scheduled:
            request = requests[scheduled.request_id]
            request.num_computed_tokens += len(scheduled.token_ids)
            self.block_manager.cache_full_pages(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose pages already hold its KV (computed by a prefill engine) to the running
        batch: its next step is a decode. If it is preempted, it is recomputed like any other."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its pages."""
        self.detach(request)
        self.block_manager.free(request)

    def detach(self, request: Request) -> None:
        """Take a request out of the queues, keeping its pages (a finished prefill awaiting transfer)."""
        self._finished_ids.append(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
