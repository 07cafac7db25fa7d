"""The engine loop: admit requests, then step = schedule → execute → update from output.

LLMEngine is the facade over its parts: admission (checks and caps), the scheduler and block manager,
the model runner, the output processor (tokens → deltas, stop checks, text), and the KV connectors
(workers.engine.connectors: the store; disaggregation, the KV exported by a prefill engine and taken
in by a decode engine; a resume from tokens). `add_request(EngineRequest)` is the only way in.
"""

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter

import torch

from workers.cost_model import PredictionErrorTracker
from workers.engine.admission import MAX_PENDING_TRANSFERS, Admission, check_cache_hints
from workers.engine.config import EngineConfig
from workers.engine.connectors.base import ComputeHere, KVArrival, KVConnector
from workers.engine.connectors.handoff import Disaggregation, continued_request
from workers.engine.connectors.resume import ResumeConnector
from workers.engine.connectors.store import StoreConnector
from workers.engine.dtypes import FP8_E4M3, dtype_name
from workers.engine.engine_core import EngineCore, EngineInfo, EngineStats, EPGroupState
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.host_memory import reuse_freed_memory
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.kv.swa_state import LocalSwaState, SwaStateCache, SwaStateSource
from workers.engine.kv.swa_stats import SwaStats
from workers.engine.kv.window_replay import ReplayPolicy
from workers.engine.kv_handoff import KVHandoff
from workers.engine.model_loader import LoadedModel
from workers.engine.output_processor import OutputProcessor
from workers.engine.outputs import RequestDelta, RequestFailure
from workers.engine.parallel.placement import Placement
from workers.engine.request import PENDING_TOKEN, FinishReason, PromptImages, Request, RequestStatus
from workers.engine.resumption import ResumeStats, check_resumable, check_suspendable, with_seed
from workers.engine.runner.model_runner import LaunchedStep, ModelRunner, SampledToken
from workers.engine.sched.output import SchedulerOutput
from workers.engine.sched.scheduler import Scheduler
from workers.engine.sched.step_budget import StepBudget
from workers.engine.sizing.kv_sizing import kv_cache_size
from workers.engine.spec.drafter import Drafter
from workers.engine.spec.speculator import speculator_for
from workers.engine.step_stats import StepStats
from workers.engine.structured.constraint import ConstraintError, IsolatedConstraint, TokenConstraint
from workers.kvstore.block_hash import kv_model_id, namespace_extra
from workers.kvstore.hints import RetentionCaps
from workers.kvstore.store import KVStore
from workers.protocol.engine_request import (
    ComputePrompt,
    ContinueFromTokens,
    EngineRequest,
    KVSource,
    Migrated,
    Prefilled,
)
from workers.protocol.errors import InvalidConstraintError, InvalidRequestError
from workers.protocol.images import check_images
from workers.protocol.messages import OutputConstraintSpec
from workers.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# (request id, spec) -> the request's constraint; InvalidConstraintError when the spec does not compile.
ConstraintCompiler = Callable[[str, OutputConstraintSpec], TokenConstraint]

# Longest a step with nothing to run waits for a store fetch before returning to its caller.
FETCH_WAIT_S = 0.01


@dataclass(frozen=True, slots=True)
class Reservation:
    """Pages a handed-over request holds before it runs (LLMEngine.reservation): its KV goes into
    `pages` from token `start` on (a multiple of the page size)."""

    request_id: str
    pages: list[int]
    start: int


class LLMEngine(EngineCore):
    """`store`, when given, is the global KV block store: prompts fetch their stored prefix from it
    and every block the engine completes is written to it (see connectors.store).

    Disaggregated serving: a prefill engine admits requests with `prefill_only=True`; each finishes
    with FinishReason.TRANSFER after its first token, keeping its pages until the caller has taken
    `export_kv(request_id)` and called `release_transfer(request_id)`. A decode engine receives the
    handoff into its handoff connector and continues it with a Prefilled request
    (connectors.handoff.continuing). At most `max_pending_transfers` prefill-only requests exist at
    once (see MAX_PENDING_TRANSFERS).

    `compile_constraint(request_id, spec)` turns a request's output constraint into the engine's
    TokenConstraint (default: the grammar compiler with the engine's tokenizer), raising
    InvalidConstraintError when it does not compile.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        store: KVStore | None = None,
        *,
        max_pending_transfers: int = MAX_PENDING_TRANSFERS,
        compile_constraint: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.config = config
        device = torch.device(config.args.device)
        if device.type == "cpu":
            reuse_freed_memory()
        dtype = next(loaded.model.parameters()).dtype
        # What decides the bytes of a KV block besides the tokens: blocks of another dtype, computed by
        # weights stored otherwise (fp8) or stored in another KV dtype never match.
        self.kv_model_id = kv_model_id(
            loaded.name, str(dtype).removeprefix("torch."), config.args.kv_cache_dtype, loaded.weight_dtype
        )
        kv_size = kv_cache_size(loaded, config, dtype=dtype, device=device)
        log.info("KV cache: %s", kv_size)
        specs = KVCacheSpecs.of_model(
            loaded.config, dtype=dtype, page_size=config.args.page_size, kv_cache_dtype=config.args.kv_cache_dtype
        )
        # A cache of several KV groups is several tensors: no one pool for a peer to map, so its KV
        # travels as frames.
        kv_transfer = config.args.kv_transfer if len(specs.groups) == 1 else "zmq"
        kv_cache = KVCache(specs, num_pages=kv_size.group_num_pages, device=device, shareable=kv_transfer == "auto")
        self.runner = ModelRunner.for_engine(
            loaded.model, kv_cache, config, max_model_len=loaded.max_model_len, enforce_eager=config.args.enforce_eager
        )
        replay = ReplayPolicy.of(specs, config.args.swa_replay) if self.runner.backend.supports_window_replay else None
        self.block_manager = BlockManager(
            num_pages=kv_size.group_num_pages,
            page_size=config.args.page_size,
            enable_prefix_caching=config.args.enable_prefix_caching,
            windows=specs.windows,
            replay=replay,
        )
        self.step_budget = (
            StepBudget(config.cost_model, config.step_budget_s) if config.step_budget_s is not None else None
        )
        # A hybrid model's SWA state and replays (kv.swa_stats); None for a model without windows.
        self.swa_stats = SwaStats() if len(specs.groups) > 1 else None
        speculator = speculator_for(config, drafter)
        self.spec_stats = speculator.stats if speculator is not None else None
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.args.max_num_seqs,
            max_num_batched_tokens=config.args.max_num_batched_tokens,
            step_budget=self.step_budget,
            swa_stats=self.swa_stats,
            speculator=speculator,
            # MTP drafts the positions after a decode's tokens: their latents need pages.
            num_lookahead_tokens=config.args.spec_max_draft_tokens if self.runner.mtp_pass is not None else 0,
        )
        self.prediction_errors = PredictionErrorTracker() if config.cost_model is not None else None
        self.step_stats = StepStats()
        # A launched step whose sampled ids are read at the next step (async scheduling), with its
        # scheduler output and start time.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep, float] | None = None
        self._last_finished_at: float | None = None  # when the last step's result was read (speculation's valve)
        self.store = (
            StoreConnector(
                store,
                kv_cache,
                self.block_manager,
                block_tokens=config.args.kv_block_tokens,
                retention_caps=RetentionCaps(
                    config.args.kv_store_max_retained_tokens, config.args.kv_store_max_retention_s
                ),
                swa_stats=self.swa_stats,
            )
            if store is not None
            else None
        )
        window = self.store.window_spec if self.store is not None else None
        if window is not None and config.args.swa_state_bytes:
            cache = SwaStateCache(window, config.args.kv_block_tokens, config.args.swa_state_bytes)
            self.store.use_swa_state(LocalSwaState(cache, self.swa_stats))
        self.kv_store = store
        self.info = EngineInfo(
            model_name=loaded.name,
            model_config=loaded.config,
            tokenizer=loaded.tokenizer,
            max_model_len=loaded.max_model_len,
            kv_model_id=self.kv_model_id,
            page_size=config.args.page_size,
            kv_layout=kv_cache.specs.layout,
            kv_block_tokens=config.args.kv_block_tokens if store is not None else 0,
            kv_transfer=kv_transfer,
            swa_state_spec=window,
            weight_dtype=loaded.weight_dtype,
            kv_cache_dtype=FP8_E4M3 if config.args.kv_cache_dtype == "fp8" else dtype_name(dtype),
        )
        self.requests: dict[str, Request] = {}
        self.max_pending_transfers = max_pending_transfers
        # Seeds for sampled requests that have none: a request's draws then depend on its seed and
        # position alone, so another engine can continue it (a handoff, a migration, a resume).
        self._seeds = random.Random(config.args.seed)
        self.resume_stats = ResumeStats()
        self.admission = Admission(
            vocab_size=loaded.config.vocab_size,
            max_model_len=self.max_model_len,
            has_tokenizer=self.tokenizer is not None,
            block_manager=self.block_manager,
            scheduler=self.scheduler,
            max_waiting=config.args.max_waiting,
            max_num_seqs=config.args.max_num_seqs,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.disaggregation = Disaggregation(
            kv_cache, self.block_manager, kv_model_id=self.kv_model_id, vocab_size=loaded.config.vocab_size
        )
        self.compile_constraint = compile_constraint or grammar_compiler(self.tokenizer, loaded.config.vocab_size)
        # Where a request's KV comes from, by its EngineRequest's source, and how the request is made.
        self.connectors: dict[type[KVSource], KVConnector] = {
            ComputePrompt: self.store if self.store is not None else ComputeHere(),
            ContinueFromTokens: ResumeConnector(self.store, self.resume_stats),
            Prefilled: self.disaggregation,
            Migrated: self.disaggregation,
        }
        self._new_request = {
            ComputePrompt: self._computed,
            ContinueFromTokens: self._continued_from_tokens,
            Prefilled: self._handed_over,
            Migrated: self._handed_over,
        }
        # Connectors that keep what each step computed: the store.
        self.savers: list[KVConnector] = [self.store] if self.store is not None else []

    def add_request(self, request: EngineRequest) -> None:
        """Admit a request, or raise InvalidRequestError naming the problem (InvalidConstraintError for
        a constraint that does not compile), or EngineOverloadedError when it cannot wait or run now;
        either way nothing is changed, except that KV received for a refused request is dropped.

        `request.kv` says where its KV comes from, and picks the connector that brings it:
        ComputePrompt: the prompt is computed here, from what the local prefix cache and the store
        hold of it on. ContinueFromTokens: another engine decoded it and was lost; its KV comes from
        the store for every full block stored and is recomputed for the rest, and its next step
        samples the token after the given ones (its params carry the seed it was sampled with).
        Prefilled, Migrated: its KV was received into the handoff connector (Disaggregation.receive)
        and goes into pages (those the prefix cache holds are shared, not written again): host
        layers at once, its next step a decode; another engine's pages are copied in by the caller
        between this call (see reservation) and admit_prefilled or cancel_prefilled.

        The constraint is compiled here; one that fails on tokens already sampled raises
        ConstraintError. `prompt_logprobs=k` reports, with the first output, each prompt token's
        logprob and its top k; `prefill_only` ends the request after its first token with finish
        reason "transfer" (unless that token already finished it: stop or length) and pins its KV
        for export_kv; `tenant` and `tenant_weight` place it in the waiting queue by its tenant's
        fair share; `cache_hints` ask the KV store to keep prefixes of the prompt.
        """
        source = type(request.kv)
        connector = self.connectors.get(source)
        if connector is None:
            raise InvalidRequestError(f"request {request.request_id!r} brings KV from {source.__name__}: unknown here")
        try:
            connector.check(request)
            constraint = self._compile(request)
            new = self._new_request[source](request, constraint)
            try:
                arrival = connector.load(new)
            except BaseException:
                self.outputs.remove(new.request_id)
                raise
        except BaseException:
            connector.discard(request.request_id)
            raise
        if arrival is KVArrival.WAITING:
            self.requests[new.request_id] = new
            self.scheduler.add(new)
        elif arrival is KVArrival.READY:
            self.admit_prefilled(new.request_id)

    def _computed(self, request: EngineRequest, constraint: TokenConstraint | None) -> Request:
        max_tokens = self.admission.max_tokens(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.prompt_logprobs,
            request.traffic_class,
            in_use=self._in_use(request.request_id),
        )
        check_cache_hints(request.cache_hints, len(request.prompt_token_ids))
        images = self._prompt_images(request, request.prompt_token_ids)
        self.admission.check_room_to_wait()
        if request.prefill_only:
            pending = len(self.disaggregation) + sum(1 for r in self.requests.values() if r.prefill_only)
            self.admission.check_room_to_transfer(pending, self.max_pending_transfers)
        new = Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=with_seed(request.params, self._seeds),
            max_tokens=max_tokens,
            hash_extra=namespace_extra(self.kv_model_id, request.cache_namespace),
            cache_namespace=request.cache_namespace,
            prefill_only=request.prefill_only,
            images=images,
            constraint=self._isolated(constraint),
            prompt_logprobs=request.prompt_logprobs,
            traffic_class=request.traffic_class,
            tenant=request.tenant,
            tenant_weight=request.tenant_weight,
            retention=self.store.plan_retention(request.cache_hints) if self.store is not None else (),
            stored_tokens_by_hint=(0,) * len(request.cache_hints),
            queued_at=time.monotonic(),
        )
        self.outputs.add(new)
        return new

    def _continued_from_tokens(self, request: EngineRequest, constraint: TokenConstraint | None) -> Request:
        output_token_ids = request.kv.output_token_ids
        max_tokens = self.admission.max_tokens(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            None,
            request.traffic_class,
            in_use=self._in_use(request.request_id),
        )
        check_resumable(request.request_id, output_token_ids, request.params, max_tokens, self.model_config.vocab_size)
        images = self._prompt_images(request, request.prompt_token_ids)
        self.admission.check_room_to_wait()
        new = Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=request.params,
            max_tokens=max_tokens,
            hash_extra=namespace_extra(self.kv_model_id, request.cache_namespace),
            cache_namespace=request.cache_namespace,
            output_token_ids=list(output_token_ids),
            images=images,
            constraint=self._isolated(constraint),
            traffic_class=request.traffic_class,
            tenant=request.tenant,
            tenant_weight=request.tenant_weight,
            # What the client was told about the prompt's cache hits stays what the first worker said.
            reported_cached_tokens=request.kv.num_cached_tokens,
            queued_at=time.monotonic(),
        )
        if new.constraint is not None:
            for token in new.output_token_ids:
                new.constraint.advance(token)
        self.outputs.add_continued(new)
        return new

    def _handed_over(self, request: EngineRequest, constraint: TokenConstraint | None) -> Request:
        """InvalidRequestError when the handoff does not fit this engine (model, layer count, head
        shapes, dtype, token counts); EngineOverloadedError when the running batch is full, so the
        caller can pick another engine; ConstraintError when the constraint fails on the tokens
        already sampled, and whatever seeding the output text with them raises."""
        handoff = self.disaggregation.handoff_of(request.request_id)
        max_tokens = self.admission.max_tokens(
            handoff.request_id,
            handoff.prompt_token_ids,
            handoff.params,
            None,
            handoff.traffic_class,
            in_use=self._in_use(handoff.request_id),
        )
        self.disaggregation.fits(handoff, max_tokens=max_tokens)
        images = self._prompt_images(request, handoff.prompt_token_ids)
        self.admission.check_room_to_run(num_reserved=len(self.disaggregation.reserved))
        new = continued_request(
            handoff,
            max_tokens=max_tokens,
            hash_extra=namespace_extra(self.kv_model_id, handoff.cache_namespace),
            constraint=self._isolated(constraint),
        )
        # Its prompt pages are keyed (and, after a preemption, recomputed) with its images.
        new.images = images
        # What may fail for this request alone runs before its KV takes pages.
        if new.constraint is not None:
            for token in new.output_token_ids:
                new.constraint.advance(token)
        self.outputs.add_continued(new)
        return new

    def _prompt_images(self, request: EngineRequest, prompt: list[int]) -> PromptImages | None:
        """The request's images, checked against the model and its prompt (InvalidRequestError naming
        the field); None for a text prompt. A vision-language model's config names its image token."""
        image_token_id = getattr(self.model_config, "image_token_id", None)
        check_images(request.images, prompt, image_token_id=image_token_id, hidden_size=self.model_config.hidden_size)
        if not request.images:
            return None
        return PromptImages.of(prompt, image_token_id, request.images)

    def _compile(self, request: EngineRequest) -> TokenConstraint | None:
        if request.constraint is None:
            return None
        return self.compile_constraint(request.request_id, request.constraint)

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    def reservation(self, request_id: str) -> Reservation:
        """The pages reserved for a request added with KV that the caller copies in page to page,
        from `start` on (the prefix cache holds the ones before)."""
        request = self.disaggregation.reserved[request_id]
        return Reservation(request_id, list(request.pages), self.disaggregation.starts[request_id])

    def admit_prefilled(self, request_id: str) -> None:
        """A reserved request's KV is in its pages: it joins the running batch, its next step a decode."""
        request = self.disaggregation.admit(request_id)
        # Its first token came from the prefill engine: here it decodes, from now.
        request.first_token_at = time.monotonic()
        if self.store is not None:
            # The prompt's blocks are the prefill side's to store; decode stores the blocks it completes.
            request.num_saved_blocks = len(request.prompt_token_ids) // self.store.block_tokens
        self.requests[request.request_id] = request
        self.scheduler.add_running(request)

    def cancel_prefilled(self, request_id: str) -> bool:
        """Give a reserved request's pages back (its KV did not arrive); False when it is not reserved."""
        if self.disaggregation.cancel(request_id) is None:
            return False
        self.outputs.remove(request_id)
        return True

    def export_kv(self, request_id: str) -> KVHandoff:
        """The handoff of a request that finished with "transfer". Its layers are read from the
        pinned pages as they are accessed: read them before release_transfer."""
        return self.disaggregation.export_kv(request_id)

    def release_transfer(self, request_id: str) -> bool:
        """Unpin a transferred (or abandoned) request's pages; False when none were pinned for it."""
        return self.disaggregation.release(request_id)

    def suspend_for_migration(self, request_id: str) -> RequestDelta | None:
        """Stop decoding a running request and pin its pages for export_kv, as a finished prefill's:
        its last delta has finish reason "transfer" and no tokens. None (nothing changed) when the
        request is not between two decode steps here: waiting, recomputing, or its sampled token
        not yet read (async scheduling); try again after the next step."""
        request = self.requests.get(request_id)
        if request is None or self._in_flight is not None or not check_suspendable(request):
            return None
        request.finish(FinishReason.TRANSFER)
        return self._release(request, self.outputs.delta(request, [], []))

    def resume_suspended(self, request_id: str) -> bool:
        """Undo suspend_for_migration: the request decodes here again from its pinned pages, as a
        request continued from a handoff would (no other engine had room for it). False (nothing
        changed) when the request is not suspended here; an export taken of it is closed."""
        request = self.disaggregation.take_back(request_id)
        if request is None:
            return False
        request.status = RequestStatus.RUNNING
        request.finish_reason = request.stop_reason = None
        request.num_pages_sent = -1  # the runner dropped it: it is described again in full
        self.outputs.add_continued(request)
        self.requests[request_id] = request
        self.scheduler.add_running(request)
        return True

    def store_prompt_tail(self, request_id: str) -> None:
        """Store the KV of the whole pages of the request's partial last prompt block, once, so that
        an engine resuming it from a checkpoint recomputes only the tokens it generated since its
        last full block (see connectors.store). Nothing without a store, or before that KV exists."""
        request = self.requests.get(request_id)
        if self.store is not None and request is not None:
            self.store.store_prompt_tail(request)

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Cancel a request: a delta with finish reason "abort", or None when the engine does not run
        it. A finished prefill awaiting transfer has reported its finish; aborting it only frees it."""
        if self.release_transfer(request_id):
            return None
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish(FinishReason.ABORT)
        return self._release(request, self.outputs.delta(request, [], []))

    def fail_request(self, request_id: str, message: str, *, kind: str = "internal") -> RequestDelta | None:
        """End a request that failed on its own, freeing its pages, while the others go on: a delta
        with finish reason "error" and the failure (kind as RequestFailure's), or None when the
        engine does not run it."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish(FinishReason.ERROR)
        return self._release(request, self.outputs.failed(request, RequestFailure(kind, message)))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """Schedule and run one step; return the deltas of the tokens sampled.

        With async scheduling (a deferrable step on the device path), a step is launched and its
        tokens are read one call later: the requests it samples for get a pending token, so the
        next step is scheduled, prepared and launched while the device still runs this one.
        """
        output = self.scheduler.schedule()
        in_flight, self._in_flight = self._in_flight, None
        if output.is_empty:
            if in_flight is None:
                self._last_finished_at = None  # idle: the time until the next step is no step's
                self._wait_for_fetches()
                return []
            return self._finish(*in_flight)
        if output.loads:
            self.store.copy_in(output.loads)
        started = time.perf_counter()
        launched = self.runner.launch(output)
        self.scheduler.finish_step(output, self.requests)
        deltas = self._finish(*in_flight) if in_flight is not None else []
        if launched.can_defer and self._can_defer(output):
            self._in_flight = (output, launched, started)
            self._add_pending_tokens(output)
            return deltas
        return deltas + self._finish(output, launched, started)

    def _finish(self, output: SchedulerOutput, launched: LaunchedStep, started: float) -> list[RequestDelta]:
        """Read a launched step's results and turn them into deltas."""
        result = launched.result()
        seconds = time.perf_counter() - started
        self.step_stats.record(seconds, output.num_tokens)
        if self.prediction_errors is not None:
            self._record_prediction(output, seconds)
        for computed in result.prompt_logprobs:
            self.requests[computed.request_id].record_prompt_logprobs(computed.first_index, computed.entries)
        if self.savers:
            # Requests finished since the step was launched are gone from self.requests.
            stepped = [self.requests[request_id] for request_id in output.request_ids if request_id in self.requests]
            for connector in self.savers:
                connector.save(stepped)
        if self.scheduler.speculator is not None:
            self._keep_accepted(output, result.num_accepted)
            finished_at = time.perf_counter()
            if self._last_finished_at is not None:
                seconds = finished_at - self._last_finished_at
                self.scheduler.speculator.record_step(seconds, len(result.sampled))
            self._last_finished_at = finished_at
        if self.runner.mtp_pass is not None:
            self.scheduler.speculator.drafter.receive(result.drafts)
        deltas = []
        for request_id, sampled in groupby(result.sampled, key=attrgetter("request_id")):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # finished or aborted since the step was launched: its token is dropped
            was_pending = request.has_pending_token
            if was_pending:
                request.output_token_ids.pop()  # the sampled id takes the pending token's place
            deltas.append(self._update(request, list(sampled)))
            if was_pending and not request.is_finished:
                # Pages that filled while the token was pending can be keyed now.
                self.block_manager.cache_full_pages(request)
        return deltas

    def _keep_accepted(self, output: SchedulerOutput, num_accepted: dict[str, int]) -> None:
        """Tell the speculator what the step's drafts became, and take each request's rejected drafts
        back out of its computed tokens: their KV slots (in pages the request keeps, as room for its
        next drafts) are written over by the tokens that take their positions. The scheduler keyed only
        pages of known tokens, which drafts are not, so no page holding a draft's KV was keyed."""
        verified = {request_id: len(drafts) for request_id, drafts in output.draft_token_ids.items()}
        self.scheduler.speculator.observe(verified, num_accepted)
        for request_id, drafts in output.draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.num_computed_tokens -= len(drafts) - num_accepted[request_id]
                request.draft_token_ids = []

    def _can_defer(self, output: SchedulerOutput) -> bool:
        """Whether the next step may be scheduled before this one's tokens are read: not for a prefill
        that hands its KV off after its first token, and not while speculating (drafts follow a
        request's last token, which a deferred step leaves pending): only in the plain phase of
        DSpark's valve (spec.valve), whose next step is planned in the same phase."""
        return (
            self.config.args.async_scheduling
            and (self.spec_stats is None or not self.scheduler.speculator.drafting)
            and not any(
                sample and _is_prefill_only(self.requests.get(request_id))
                for request_id, sample in zip(output.request_ids, output.sample, strict=True)
            )
        )

    def _add_pending_tokens(self, output: SchedulerOutput) -> None:
        """Each request that sampled in the launched step and may go on gets a pending token, so the
        next schedule() gives it a decode step before its sampled id is known."""
        for request_id, sample in zip(output.request_ids, output.sample, strict=True):
            request = self.requests.get(request_id) if sample else None
            # A request the previous step finished is gone; its token from this step will be dropped.
            if request is not None and len(request.output_token_ids) + 1 < request.max_tokens:
                request.output_token_ids.append(PENDING_TOKEN)

    def _record_prediction(self, output: SchedulerOutput, seconds: float) -> None:
        rows = list(zip(output.num_scheduled_tokens, output.num_computed_tokens, strict=True))
        self.prediction_errors.record(self.config.cost_model.predict_step(rows), seconds)

    def _wait_for_fetches(self) -> None:
        """With nothing to run but store fetches in flight, wait for one rather than spin: a spinning
        caller would hold the GIL the reader threads need."""
        fetches = [r.store_fetch for r in self.scheduler.waiting if r.is_fetching]
        if fetches:
            wait(fetches, timeout=FETCH_WAIT_S, return_when=FIRST_COMPLETED)

    def apply_layout(self, num_logical_experts: int, placement: Placement) -> None:
        """Nothing to put in force: one process holds every expert of its model, if it has any."""

    def take_expert_load(self) -> list[list[int]]:
        return []

    def ep_group(self) -> EPGroupState:
        return EPGroupState()

    def use_swa_state(self, source: SwaStateSource) -> None:
        if self.store is None:
            raise ValueError("an engine without a KV store keeps no SWA state: it has no store hit to continue")
        self.store.use_swa_state(source)

    def close(self) -> None:
        """Finish writing to the KV store; the engine is not used afterwards."""
        if self.store is not None:
            self.store.close()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_pages=self.block_manager.num_free_pages,
            num_pages=self.block_manager.num_usable_pages,
            kv_usage=self.block_manager.usage,
            num_computed_tokens=self.runner.num_computed_tokens,
            num_prompt_tokens=self.scheduler.num_admitted_prompt_tokens,
            num_cached_prompt_tokens=self.scheduler.num_cached_prompt_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            swa=self.swa_stats,
            store=self.store.stats() if self.store is not None else None,
            num_pending_transfers=len(self.disaggregation),
            resume=self.resume_stats,
            cost_model_error=self.prediction_errors.percentiles() if self.prediction_errors else (0.0, 0.0),
            steps=self.step_stats,
            spec_decode=self.spec_stats,
        )

    def _update(self, request: Request, sampled: list[SampledToken]) -> RequestDelta:
        """Append a step's sampled tokens to their request (see OutputProcessor.process); release it
        when finished, or fail it alone when processing its tokens raised."""
        if request.resumed_at:
            self.resume_stats.first_token(request)
        try:
            delta = self.outputs.process(request, sampled)
        except ConstraintError as error:
            return self.fail_request(request.request_id, str(error), kind="constraint")
        except Exception as error:
            log.exception("processing a token of request %s failed; the request fails alone", request.request_id)
            return self.fail_request(request.request_id, f"processing its output failed: {error!r}")
        return self._release(request, delta) if request.is_finished else delta

    def _release(self, request: Request, delta: RequestDelta) -> RequestDelta:
        """A finished request leaves the engine; one that finished with "transfer" stays pinned."""
        if request.finish_reason is FinishReason.TRANSFER:
            self.scheduler.detach(request)
            self.disaggregation.hold(request)
        else:
            self.scheduler.remove(request)
        del self.requests[request.request_id]
        self.outputs.remove(request.request_id)
        return delta

    def _isolated(self, constraint: TokenConstraint | None) -> IsolatedConstraint | None:
        return IsolatedConstraint(constraint, self.model_config.vocab_size) if constraint is not None else None

    def _in_use(self, request_id: str) -> bool:
        return (
            request_id in self.requests
            or request_id in self.disaggregation
            or request_id in self.disaggregation.reserved
        )


def grammar_compiler(tokenizer: Tokenizer | None, vocab_size: int) -> ConstraintCompiler:
    """The default ConstraintCompiler: the grammar library (structured.grammar) with the model's tokenizer."""

    def compile_spec(request_id: str, spec: OutputConstraintSpec) -> TokenConstraint:
        # Imported here: only constrained requests need the grammar library.
        from workers.engine.structured.grammar import compile_constraint

        if tokenizer is None:
            raise InvalidConstraintError("output constraints need a tokenizer; this model was loaded without one")
        try:
            return compile_constraint(spec, tokenizer, vocab_size)
        except InvalidRequestError as error:
            raise InvalidConstraintError(str(error)) from error

    return compile_spec


def _is_prefill_only(request: Request | None) -> bool:
    return request is not None and request.prefill_only
