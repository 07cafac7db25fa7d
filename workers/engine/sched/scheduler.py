"""Continuous batching with chunked prefill, prefix hits and preemption by recompute.

Each step the scheduler decides how many tokens every request computes, within a token budget:
running requests first, in arrival order (a decode costs one token, an unfinished prefill
continues with the next chunk), then waiting requests, whose cached prefix pages are attached
first (except for a request that reports prompt logprobs: every prompt position must produce
logits). Waiting requests are admitted in the waiting queue's order: preempted ones first, then by
fair share of their tenants (see waiting). A hybrid model's hit may replay its windows first
(kv.window_replay): the request then starts computing at the replay's start. While the next waiting
request is another tenant's, the running prefills of other tenants leave it the tokens it needs in
the step (up to the whole budget), so its first token waits for the step in progress, not for the
rest of a long prompt. With speculative decoding (spec.speculator), a running request's decode also
computes the tokens drafted after its last one, within the step's tokens and the request's
max_tokens, and its pages cover them; verification keeps the accepted ones. When pages run out, the
most recently admitted running request is preempted: its pages are freed and it goes back to the
front of the queue to be recomputed later. The scheduler moves request objects and lists of ints; it
never touches tensors.
"""

import time

import torch

from workers.engine.connectors.store import KVLoad, LoadedBlocks
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.swa_stats import SwaStats
from workers.engine.request import Request, RequestStatus
from workers.engine.sched.output import NewRequestData, SchedulerOutput
from workers.engine.sched.step_budget import StepBudget, StepTimeLeft
from workers.engine.sched.waiting import WaitingQueue
from workers.engine.spec.speculator import Speculator
from workers.kvstore.block_hash import BlockHash


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_budget: StepBudget | None = None,
        num_lookahead_tokens: int = 0,
        swa_stats: SwaStats | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`step_budget`, when given, also caps each step by predicted time (see step_budget);
        `num_lookahead_tokens` more slots past every scheduled token are covered by pages (room for
        speculative tokens); `swa_stats` counts a hybrid model's window replays (the engine's);
        `speculator`, when given, drafts tokens that each decode step verifies after its token (they
        are scheduled, and given pages, like the tokens they may become)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_budget = step_budget
        self.num_lookahead_tokens = num_lookahead_tokens
        self.speculator = speculator
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_admitted_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0  # of the admitted prompt tokens, those hit in the prefix cache
        self.num_preemptions = 0
        self.swa_stats = swa_stats or SwaStats()  # a hybrid model's window replays
        self._finished_ids: list[str] = []

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        time_left = self.step_budget.start_step() if self.step_budget is not None else None
        plan: list[tuple[Request, int]] = []
        preempted: list[str] = []
        # The request the waiting loop would admit first, and the budget kept for it from other
        # tenants' running prefills; none when the running batch is full and it could not be admitted.
        next_waiting = next((request for request in self.waiting if not request.is_fetching), None)
        can_admit = next_waiting is not None and len(self.running) < self.max_num_seqs
        reserve = min(next_waiting.num_tokens, self.max_num_batched_tokens) if can_admit else 0

        drafts = self._plan_drafts() if self.speculator is not None else {}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if count > 1 and reserve and request.tenant != next_waiting.tenant:
                count = max(0, min(count, budget - reserve))
            if count == 1 and request.request_id in drafts:
                # Drafts leave a token for every running request after this one.
                room = budget - 1 - (len(self.running) - index - 1)
                request.draft_token_ids = drafts[request.request_id].token_ids[: max(room, 0)]
                count += len(request.draft_token_ids)
            if count and time_left is not None:
                count = self._fit(time_left, request, count, first=not plan)
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
            hit_tokens = cached_tokens + loaded_tokens
            # A store hit that brought its SWA state needs no replay: the state fills fresh window pages.
            window_runs = loaded.window_runs if loaded is not None else None
            replay = None if window_runs else self.block_manager.replay_for_hit(request, cached, loaded_tokens)
            start = replay.start if replay is not None else hit_tokens
            if replay is not None:
                window_start = start
            elif window_runs:
                # The pages of the tokens the next query's window reads, not all of the runs' blocks.
                runs_start = hit_tokens - sum(run.shape[3] for run in window_runs)
                first_read = max(hit_tokens - self.block_manager.widest_window + 1, runs_start)
                window_start = first_read // page_size * page_size
            else:
                window_start = None
            count = min(request.num_tokens - start, budget)
            if time_left is not None:
                count = time_left.fit(count, start, first=not plan)
                if not count:
                    break
            if not self.block_manager.allocate(
                request,
                max(start + count, hit_tokens) - cached_tokens,
                cached,
                lookahead=self.num_lookahead_tokens,
                window_start=window_start,
            ):
                break
            self.waiting.pop(position)
            request.store_fetch = None
            if loaded:
                first = loaded.first_page
                window_pages, window_state = [], []
                if window_runs:
                    window_pages = self.block_manager.pages_of(request, 1)[
                        window_start // page_size : hit_tokens // page_size
                    ]
                    window_state = [torch.cat(window_runs, dim=3)[:, :, :, window_start - runs_start :]]
                loads.append(
                    KVLoad(
                        pages=request.pages[first : first + loaded.num_pages],
                        blocks=loaded.blocks,
                        window_pages=window_pages,
                        window_runs=window_state,
                    )
                )
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit_tokens
                self.num_admitted_prompt_tokens += len(request.prompt_token_ids)
                self.num_cached_prompt_tokens += hit_tokens
            if replay is not None:
                self.swa_stats.count_replay(replay.start, replay.end)
            request.window_replay = replay
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            if not request.scheduled_at:
                request.scheduled_at = time.monotonic()
            self.running.append(request)
            plan.append((request, count))
            budget -= count

        finished, self._finished_ids = (self._finished_ids, []) if plan else ([], self._finished_ids)
        output = SchedulerOutput(
            num_lookahead_tokens=self.num_lookahead_tokens,
            preempted=preempted,
            loads=loads,
            finished_request_ids=finished,
        )
        for request, count in plan:
            self._describe(request, count, output)
        return output

    def _plan_drafts(self) -> dict:
        """The drafts of the running requests whose next step is a decode, by request id: planned
        together, since the verification budget splits one total among them."""
        decoding = [
            request
            for request in self.running
            if request.output_token_ids and request.num_tokens - request.num_computed_tokens == 1
        ]
        return self.speculator.plan(decoding) if decoding else {}

    @staticmethod
    def _fit(time_left: StepTimeLeft, request: Request, count: int, *, first: bool) -> int:
        """What of `count` tokens fits the step's time; a drafting decode keeps its token and as many
        drafts as fit."""
        granted = time_left.fit(count, request.num_computed_tokens, first=first)
        if request.draft_token_ids:
            granted = granted or time_left.fit(1, request.num_computed_tokens, first=first)
            request.draft_token_ids = request.draft_token_ids[: granted - 1]
        return granted

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
        while not self.block_manager.allocate(request, count, lookahead=self.num_lookahead_tokens):
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.reset_for_recompute()
            self.waiting.push_front(victim)
            preempted.append(victim.request_id)
            self.num_preemptions += 1
            if victim is request:
                return False
        return True

    def _describe(self, request: Request, count: int, output: SchedulerOutput) -> None:
        """Add the request's share of the step: in full if the runner does not hold it yet, else the
        pages it was given since it was last described (every group's table grows by the same pages'
        worth of positions; a window's released pages are not sent, the runner's stale ids for them are
        never read)."""
        start = request.num_computed_tokens
        output.request_ids.append(request.request_id)
        output.num_scheduled_tokens.append(count)
        output.num_computed_tokens.append(start)
        output.sample.append(start + count - len(request.draft_token_ids) == request.num_tokens)
        if request.draft_token_ids:
            output.draft_token_ids[request.request_id] = request.draft_token_ids
        tables = [self.block_manager.pages_of(request, group) for group in range(len(self.block_manager.pools))]
        if request.num_pages_sent < 0:
            output.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    params=request.params,
                    constraint=request.constraint,
                    prompt_logprobs=request.prompt_logprobs,
                    block_ids=tuple(list(table) for table in tables),
                    window_replay=request.window_replay,
                    images=request.images,
                )
            )
        elif len(request.pages) > request.num_pages_sent:
            output.new_block_ids[request.request_id] = tuple(table[request.num_pages_sent :] for table in tables)
        request.num_pages_sent = len(request.pages)

    def finish_step(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Advance computed-token counts and key the pages that became full."""
        for request_id, count in zip(output.request_ids, output.num_scheduled_tokens, strict=True):
            request = requests[request_id]
            request.num_computed_tokens += count
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
