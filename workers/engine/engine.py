"""The engine loop: admit requests, then step = schedule → execute → update from output."""

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import torch

from kernels.attention import default_backend
from workers.block_hash import namespace_extra
from workers.cost_model import PredictionErrorTracker
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.constraints import TokenConstraint
from workers.engine.errors import EngineOverloadedError, InvalidRequestError
from workers.engine.host_memory import reuse_freed_memory
from workers.engine.kv_cache import KVCache
from workers.engine.kv_handoff import KVHandoff, PagedLayers, check_handoff, export_handoff, write_layers
from workers.engine.model_loader import LoadedModel
from workers.engine.model_runner import ModelRunner, SampledToken
from workers.engine.output_text import OutputText
from workers.engine.outputs import RequestDelta
from workers.engine.request import FinishReason, Request
from workers.engine.sampler import TokenLogprobs
from workers.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.step_budget import StepBudget
from workers.engine.store_connector import StoreConnector, StoreStats
from workers.kvstore.store import KVStore

log = logging.getLogger(__name__)

MAX_TRAFFIC_CLASS_CHARS = 64
# Prefill-only requests alive at once, computing or finished and pinning their pages until
# release_transfer: past it add_request(prefill_only=True) refuses with EngineOverloadedError. Counting
# the ones still computing is what guarantees a finished prefill never has to drop its KV; the cap
# bounds the pages a decode side that is slow to pick transfers up can hold on this engine.
MAX_PENDING_TRANSFERS = 32
# Longest a step with nothing to run waits for a store fetch before returning to its caller.
FETCH_WAIT_S = 0.01


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int
    kv_usage: float
    num_computed_tokens: int  # tokens run through the model since start
    num_prompt_tokens: int  # prompt tokens admitted since start
    num_cached_prompt_tokens: int  # of those, served from the prefix cache
    num_preemptions: int
    store: StoreStats | None  # None when the engine has no KV store
    num_pending_transfers: int = 0  # finished prefill-only requests pinning pages until released
    # (p50, p90) relative error of the cost model's step-time predictions lately; zeros without one.
    cost_model_error: tuple[float, float] = (0.0, 0.0)


class LLMEngine:
    """`store`, when given, is the global KV block store: prompts fetch their stored prefix from it
    and every block the engine completes is written to it (see store_connector).

    Disaggregated serving: a prefill engine admits requests with `prefill_only=True`; each finishes
    with FinishReason.TRANSFER after its first token, keeping its pages until the caller has taken
    `export_kv(request_id)` and called `release_transfer(request_id)`. A decode engine continues it
    with `add_prefilled_request(handoff)`. At most `max_pending_transfers` prefill-only requests
    exist at once (see MAX_PENDING_TRANSFERS).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        store: KVStore | None = None,
        *,
        max_pending_transfers: int = MAX_PENDING_TRANSFERS,
    ) -> None:
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.config = config
        device = torch.device(config.device)
        if device.type == "cpu":
            reuse_freed_memory()
        dtype = next(loaded.model.parameters()).dtype
        # What decides the bytes of a KV block besides the tokens: blocks of another dtype never match.
        self.kv_model_id = f"{loaded.name}:{str(dtype).removeprefix('torch.')}"
        num_pages = config.num_pages or KVCache.pages_for_bytes(
            loaded.config, num_bytes=config.kv_cache_bytes, page_size=config.page_size, dtype=dtype
        )
        kv_cache = KVCache(loaded.config, num_pages=num_pages, page_size=config.page_size, dtype=dtype, device=device)
        self.block_manager = BlockManager(
            num_pages=num_pages, page_size=config.page_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.step_budget = (
            StepBudget(config.cost_model, config.step_budget_s) if config.step_budget_s is not None else None
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            step_budget=self.step_budget,
        )
        self.prediction_errors = PredictionErrorTracker() if config.cost_model is not None else None
        self.runner = ModelRunner(
            loaded.model,
            kv_cache,
            attention_backend=config.attention_backend or default_backend(device),
            device=device,
            seed=config.seed,
        )
        self.store = StoreConnector(store, kv_cache, block_tokens=config.kv_block_tokens) if store is not None else None
        self.requests: dict[str, Request] = {}
        self.texts: dict[str, OutputText] = {}
        self.max_pending_transfers = max_pending_transfers
        # Finished prefill-only requests whose pages stay pinned until release_transfer, and the
        # exports read from those pages (closed on release so a late read cannot see reused pages).
        self.transfers: dict[str, Request] = {}
        self.exports: dict[str, list[PagedLayers]] = {}
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_namespace: str = "",
        constraint: TokenConstraint | None = None,
        prompt_logprobs: int | None = None,
        traffic_class: str = "chat",
        prefill_only: bool = False,
    ) -> None:
        """Admit a request, or raise InvalidRequestError naming the problem, or EngineOverloadedError
        when max_waiting requests already wait (either way nothing is changed).

        `constraint` masks every sampled token and ends the request when it is finished;
        `prompt_logprobs=k` reports, with the first output, each prompt token's logprob and its top k;
        `traffic_class` sets how long the KV store keeps the blocks this request writes;
        `prefill_only` ends the request after its first token with finish reason "transfer" (unless
        that token already finished it: stop or length) and pins its KV for export_kv.
        """
        max_tokens = self._validate(request_id, prompt_token_ids, params, prompt_logprobs, traffic_class)
        max_waiting = self.config.max_waiting
        if max_waiting is not None and len(self.scheduler.waiting) >= max_waiting:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are already waiting (max_waiting)")
        if prefill_only:
            pending = len(self.transfers) + sum(1 for r in self.requests.values() if r.prefill_only)
            if pending >= self.max_pending_transfers:
                raise EngineOverloadedError(
                    f"{pending} prefill-only requests are computing or awaiting transfer (max_pending_transfers)"
                )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            hash_extra=namespace_extra(self.kv_model_id, cache_namespace),
            cache_namespace=cache_namespace,
            prefill_only=prefill_only,
            constraint=constraint,
            prompt_logprobs=prompt_logprobs,
            traffic_class=traffic_class,
        )
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self.texts[request_id] = OutputText(self.tokenizer, params)
        if self.store is not None and not request.needs_prompt_logits:
            local_pages, _ = self.block_manager.find_cached_prefix(request)
            self.store.start_fetch(request, local_hit_tokens=len(local_pages) * self.block_manager.page_size)
        self.scheduler.add(request)

    def add_prefilled_request(self, handoff: KVHandoff, *, constraint: TokenConstraint | None = None) -> None:
        """Continue a request a prefill engine started: its KV goes into pages (those the prefix
        cache already holds are shared, not written again) and its next step is a decode.

        InvalidRequestError when the handoff does not fit this engine (model, layer count, shapes,
        dtype, token counts); EngineOverloadedError when the running batch is full or its pages
        cannot be had, so the caller can pick another engine. Either way nothing is changed.
        `constraint` is compiled afresh by the caller; it is advanced over the tokens already sampled.
        """
        if not isinstance(handoff, KVHandoff):
            raise InvalidRequestError(f"expected a KVHandoff, got {type(handoff).__name__}")
        max_tokens = self._validate(
            handoff.request_id, handoff.prompt_token_ids, handoff.params, None, handoff.traffic_class
        )
        layers = check_handoff(
            handoff,
            kv_model_id=self.kv_model_id,
            vocab_size=self.model_config.vocab_size,
            max_tokens=max_tokens,
            kv_cache=self.runner.kv_cache,
        )
        if len(self.scheduler.running) >= self.config.max_num_seqs:
            raise EngineOverloadedError(f"{len(self.scheduler.running)} requests are already running (max_num_seqs)")
        request = Request(
            request_id=handoff.request_id,
            prompt_token_ids=list(handoff.prompt_token_ids),
            params=handoff.params,
            max_tokens=max_tokens,
            hash_extra=namespace_extra(self.kv_model_id, handoff.cache_namespace),
            cache_namespace=handoff.cache_namespace,
            output_token_ids=list(handoff.output_token_ids),
            traffic_class=handoff.traffic_class,
            num_cached_tokens=handoff.num_cached_tokens,
            constraint=constraint,
        )
        cached = self.block_manager.find_cached_prefix(request)
        cached_tokens = len(cached[0]) * self.block_manager.page_size
        # Pages for every token, the pending sampled one included, so its decode step needs none.
        if not self.block_manager.allocate(request, request.num_tokens - cached_tokens, cached):
            raise EngineOverloadedError(
                f"no room for {request.num_tokens} tokens of KV: "
                f"{self.block_manager.num_free_pages} of {self.block_manager.num_usable_pages} pages are free"
            )
        write_layers(self.runner.kv_cache, request.pages, layers, start=cached_tokens)
        request.num_computed_tokens = handoff.num_computed_tokens
        self.block_manager.cache_full_pages(request)
        if self.store is not None:
            # The prompt's blocks are the prefill side's to store; decode stores the blocks it completes.
            request.num_saved_blocks = len(request.prompt_token_ids) // self.store.block_tokens
        if constraint is not None:
            for token in request.output_token_ids:
                constraint.advance(token)
        if self.tokenizer is not None:
            text = OutputText(self.tokenizer, request.params)
            # The prefill side streamed these tokens' text; they only seed detokenization and stop strings.
            text.append(request.output_token_ids)
            text.take_delta()
            self.texts[request.request_id] = text
        self.requests[request.request_id] = request
        self.scheduler.add_running(request)

    def export_kv(self, request_id: str) -> KVHandoff:
        """The handoff of a request that finished with "transfer". Its layers are read from the
        pinned pages as they are accessed: read them before release_transfer."""
        request = self.transfers.get(request_id)
        if request is None:
            raise InvalidRequestError(f"request {request_id!r} is not awaiting a KV transfer")
        layers = PagedLayers(self.runner.kv_cache, request.pages, request.num_computed_tokens)
        self.exports.setdefault(request_id, []).append(layers)
        return export_handoff(request, layers, self.kv_model_id)

    def release_transfer(self, request_id: str) -> bool:
        """Unpin a transferred (or abandoned) request's pages; False when none were pinned for it."""
        request = self.transfers.pop(request_id, None)
        if request is None:
            return False
        for layers in self.exports.pop(request_id, []):
            layers.close()
        self.block_manager.free(request)
        return True

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Cancel a request: a delta with finish reason "abort", or None when the engine does not run
        it. A finished prefill awaiting transfer has reported its finish; aborting it only frees it."""
        if self.release_transfer(request_id):
            return None
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish(FinishReason.ABORT)
        return self._release(request, self._delta(request, [], []))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        output = self.scheduler.schedule()
        if not output.scheduled:
            self._wait_for_fetches()
            return []
        if output.loads:
            self.store.copy_in(output.loads)
        started = time.perf_counter()
        result = self.runner.execute(output.scheduled)
        if self.prediction_errors is not None:
            self._record_prediction(output, time.perf_counter() - started)
        for computed in result.prompt_logprobs:
            self.requests[computed.request_id].record_prompt_logprobs(computed.first_index, computed.entries)
        self.scheduler.finish_step(output, self.requests)
        if self.store is not None:
            for scheduled in output.scheduled:
                self.store.save_completed_blocks(self.requests[scheduled.request_id])
        return [self._update(token) for token in result.sampled]

    def _record_prediction(self, output: SchedulerOutput, seconds: float) -> None:
        rows = [(len(scheduled.token_ids), scheduled.start_position) for scheduled in output.scheduled]
        self.prediction_errors.record(self.config.cost_model.predict_step(rows), seconds)

    def _wait_for_fetches(self) -> None:
        """With nothing to run but store fetches in flight, wait for one rather than spin: a spinning
        caller would hold the GIL the reader threads need."""
        fetches = [r.store_fetch for r in self.scheduler.waiting if r.is_fetching]
        if fetches:
            wait(fetches, timeout=FETCH_WAIT_S, return_when=FIRST_COMPLETED)

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
            store=self.store.stats() if self.store is not None else None,
            num_pending_transfers=len(self.transfers),
            cost_model_error=self.prediction_errors.percentiles() if self.prediction_errors else (0.0, 0.0),
        )

    def _update(self, sampled: SampledToken) -> RequestDelta:
        request = self.requests[sampled.request_id]
        token = sampled.token_id
        request.output_token_ids.append(token)
        logprobs = [sampled.logprobs] if sampled.logprobs is not None else []
        request.logprobs.extend(logprobs)
        params = request.params

        if request.constraint is not None:
            request.constraint.advance(token)

        text = self.texts.get(request.request_id)
        stop_string = text.append([token]) if text is not None else None
        if token in params.stop_token_ids:
            request.finish(FinishReason.STOP, token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            request.finish(FinishReason.STOP)
        elif stop_string is not None:
            request.finish(FinishReason.STOP, stop_string)
        elif request.constraint is not None and request.constraint.is_finished():
            request.finish(FinishReason.STOP)
        elif len(request.output_token_ids) >= request.max_tokens:
            request.finish(FinishReason.LENGTH)
        elif request.prefill_only:
            request.finish(FinishReason.TRANSFER)

        # Output tokens survive preemption, so the first one is produced exactly once.
        first = len(request.output_token_ids) == 1 and request.prompt_logprobs is not None
        delta = self._delta(request, [token], logprobs, request.prompt_token_logprobs if first else None)
        return self._release(request, delta) if request.is_finished else delta

    def _delta(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> RequestDelta:
        text = self.texts.get(request.request_id)
        # A transferred request is not over: its held-back tail (a possible stop string, partial UTF-8)
        # is streamed by the decode engine, whose text is seeded to stream exactly what follows this.
        if text is not None and request.is_finished and request.finish_reason is not FinishReason.TRANSFER:
            text.finish()
        return RequestDelta(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text.take_delta() if text is not None else None,
            logprobs=logprobs,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _release(self, request: Request, delta: RequestDelta) -> RequestDelta:
        if request.finish_reason is FinishReason.TRANSFER:
            self.scheduler.detach(request)
            self.transfers[request.request_id] = request
        else:
            self.scheduler.remove(request)
        del self.requests[request.request_id]
        self.texts.pop(request.request_id, None)
        return delta

    def _validate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        prompt_logprobs: int | None,
        traffic_class: str,
    ) -> int:
        """The request's effective max_tokens, after checking everything the engine can check."""
        if request_id in self.requests or request_id in self.transfers:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not (isinstance(traffic_class, str) and 0 < len(traffic_class) <= MAX_TRAFFIC_CLASS_CHARS):
            raise InvalidRequestError(f"traffic_class must be a name of 1 to {MAX_TRAFFIC_CLASS_CHARS} characters")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise InvalidRequestError(f"the engine runs one sequence per request; fan out n={params.n} before it")
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt has {len(bad)} token ids outside the vocabulary [0, {vocab}), e.g. {bad[:3]}"
            )
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must lie in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab})")
        if prompt_logprobs is not None and not (
            isinstance(prompt_logprobs, int) and 0 <= prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs!r}")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model was loaded without one")
        room = self.max_model_len - len(prompt)
        if room <= 0:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; the context window is {self.max_model_len} tokens"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"context window of {self.max_model_len} tokens"
            )
        pages = self.block_manager.pages_needed(len(prompt) + max_tokens)
        if pages > self.block_manager.num_usable_pages:
            raise InvalidRequestError(
                f"request needs {pages} KV pages at full length; the cache has {self.block_manager.num_usable_pages}"
            )
        return max_tokens
