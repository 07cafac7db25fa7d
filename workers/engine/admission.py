"""What the engine checks before a request joins it: the request's fields against the model, the
context window and the KV cache, and the caps on waiting, running and pending-transfer requests.

Nothing here changes state: a refused request leaves the engine as it was. InvalidRequestError means
the request can never run here; EngineOverloadedError means not now (the caller may try elsewhere).
"""

import math
from collections.abc import Sequence

from workers.engine.kv.block_manager import BlockManager
from workers.engine.sched.scheduler import Scheduler
from workers.protocol.errors import EngineOverloadedError, InvalidRequestError
from workers.protocol.messages import MAX_CACHE_HINTS, CacheHint
from workers.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_TRAFFIC_CLASS_CHARS = 64
# Prefill-only requests alive at once, computing or finished and pinning their pages until
# release_transfer: past it add_request(prefill_only=True) refuses with EngineOverloadedError. Counting
# the ones still computing is what guarantees a finished prefill never has to drop its KV; the cap
# bounds the pages a decode side that is slow to pick transfers up can hold on this engine.
MAX_PENDING_TRANSFERS = 32


class Admission:
    def __init__(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        has_tokenizer: bool,
        block_manager: BlockManager,
        scheduler: Scheduler,
        max_waiting: int | None,
        max_num_seqs: int,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.has_tokenizer = has_tokenizer
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.max_waiting = max_waiting
        self.max_num_seqs = max_num_seqs

    def max_tokens(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        prompt_logprobs: int | None,
        traffic_class: str,
        *,
        in_use: bool,
    ) -> int:
        """The request's effective max_tokens, after checking everything the engine can check.
        `in_use`: whether the engine already holds a request of this id."""
        if in_use:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not (isinstance(traffic_class, str) and 0 < len(traffic_class) <= MAX_TRAFFIC_CLASS_CHARS):
            raise InvalidRequestError(f"traffic_class must be a name of 1 to {MAX_TRAFFIC_CLASS_CHARS} characters")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise InvalidRequestError(f"the engine runs one sequence per request; fan out n={params.n} before it")
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        vocab = self.vocab_size
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
        if params.stop and not self.has_tokenizer:
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

    def check_room_to_wait(self) -> None:
        """A new request waits for admission: refused once max_waiting requests wait."""
        num_waiting = len(self.scheduler.waiting)
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            raise EngineOverloadedError(f"{num_waiting} requests are already waiting (max_waiting)")

    def check_room_to_run(self, *, num_reserved: int) -> None:
        """A continued (prefilled) request joins the running batch once its KV is in: refused when the
        batch is full, counting the requests already reserved to join it."""
        num_running = len(self.scheduler.running) + num_reserved
        if num_running >= self.max_num_seqs:
            raise EngineOverloadedError(
                f"{num_running} requests are already running or receiving their KV (max_num_seqs)"
            )

    @staticmethod
    def check_room_to_transfer(num_pending: int, max_pending_transfers: int) -> None:
        """A prefill-only request: refused once `max_pending_transfers` are computing or awaiting transfer."""
        if num_pending >= max_pending_transfers:
            raise EngineOverloadedError(
                f"{num_pending} prefill-only requests are computing or awaiting transfer (max_pending_transfers)"
            )


def check_cache_hints(hints: Sequence[CacheHint], prompt_length: int) -> None:
    """A request's cache hints name prefixes of its prompt to keep, for a while (workers.kvstore.hints)."""
    if len(hints) > MAX_CACHE_HINTS:
        raise InvalidRequestError(f"a request carries at most {MAX_CACHE_HINTS} cache hints, got {len(hints)}")
    for hint in hints:
        if not isinstance(hint, CacheHint):
            raise InvalidRequestError(f"cache hints must be CacheHints, got {type(hint).__name__}")
        if not 1 <= hint.prefix_tokens <= prompt_length:
            raise InvalidRequestError(
                f"a cache hint covers 1 to {prompt_length} tokens (the prompt's), got {hint.prefix_tokens}"
            )
        if not (math.isfinite(hint.retain_s) and hint.retain_s > 0):
            raise InvalidRequestError(f"a cache hint retains for a positive number of seconds, got {hint.retain_s}")
