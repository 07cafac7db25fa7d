"""Turns each sampled token into a request's output: advances the request's constraint, appends the
token, decides whether it finished (stop token, end of sequence, stop string, constraint done,
length, or the end of a prefill-only request), and builds the RequestDelta with the text it
completes; and builds the last delta of a request that failed.

It owns the incremental detokenization of every request (OutputText), from admission until the
engine releases the request.
"""

import time

from workers.engine.output_text import OutputText
from workers.engine.outputs import RequestDelta, RequestFailure
from workers.engine.request import FinishReason, Request
from workers.engine.runner.model_runner import SampledToken
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.messages import RequestPhaseTimes
from workers.text.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[str, OutputText] = {}
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else frozenset()

    def add(self, request: Request) -> None:
        """Start the text of a new request."""
        if self.tokenizer is not None:
            self.texts[request.request_id] = OutputText(self.tokenizer, request.params)

    def add_continued(self, request: Request) -> None:
        """Start the text of a request another engine prefilled, from the tokens it already sampled."""
        if self.tokenizer is not None:
            text = OutputText(self.tokenizer, request.params)
            # The prefill side streamed these tokens' text; they only seed detokenization and stop strings.
            text.append(request.output_token_ids)
            text.take_delta()
            self.texts[request.request_id] = text

    def remove(self, request_id: str) -> None:
        self.texts.pop(request_id, None)

    def process(self, request: Request, sampled: list[SampledToken]) -> RequestDelta:
        """Append a step's sampled tokens (one, or several when it verified drafts) to their request, in
        order, until one ends it: the tokens after that one are dropped, as decoding one token per step
        would never have sampled them.

        What can fail for one request (its constraint: ConstraintError; its detokenization) runs
        before the token joins the request; the engine then fails that request (fail_request)."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        for token in sampled:
            self._append(request, token)
            token_ids.append(token.token_id)
            if token.logprobs is not None:
                logprobs.append(token.logprobs)
            if request.is_finished:
                break
        # Output tokens survive preemption, so the first one is produced exactly once.
        first = len(request.output_token_ids) == len(token_ids) and request.prompt_logprobs is not None
        return self.delta(request, token_ids, logprobs, request.prompt_token_logprobs if first else None)

    def _append(self, request: Request, sampled: SampledToken) -> None:
        """Append one sampled token and finish the request when the token ends it."""
        token = sampled.token_id
        if request.constraint is not None:
            request.constraint.advance(token)
        text = self.texts.get(request.request_id)
        stop_string = text.append([token]) if text is not None else None

        request.output_token_ids.append(token)
        if not request.first_token_at:
            request.first_token_at = time.monotonic()
        if sampled.logprobs is not None:
            request.logprobs.append(sampled.logprobs)
        params = request.params
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

    def failed(self, request: Request, failure: RequestFailure) -> RequestDelta:
        """The last delta of a request that failed: no tokens, and none of its held-back text (the
        client gets the failure instead of an ending)."""
        return RequestDelta(
            request_id=request.request_id,
            token_ids=[],
            text="" if request.request_id in self.texts else None,
            logprobs=[],
            finish_reason=FinishReason.ERROR.value,
            stop_reason=None,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            failure=failure,
        )

    def delta(
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
            num_stored_tokens=request.num_stored_prompt_tokens,
            stored_tokens_by_hint=request.stored_tokens_by_hint,
            phase_times=phase_times(request) if request.is_finished else None,
        )


def phase_times(request: Request) -> RequestPhaseTimes | None:
    """How long a finished request waited, prefilled and decoded here (see its timestamps); None
    when it ended before any of them began."""
    queue_s = prefill_s = decode_s = None
    if request.queued_at and request.scheduled_at:
        queue_s = request.scheduled_at - request.queued_at
        if request.first_token_at:
            prefill_s = request.first_token_at - request.scheduled_at
    if request.first_token_at and request.finish_reason is not FinishReason.TRANSFER:
        decode_s = time.monotonic() - request.first_token_at
    if queue_s is None and decode_s is None:
        return None
    return RequestPhaseTimes(queue_s=queue_s, prefill_s=prefill_s, decode_s=decode_s)
