"""What the engine hands back: per-step deltas (for streaming) and whole results (offline API)."""

from dataclasses import dataclass, field

from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.messages import GenerateOutput, RequestPhaseTimes


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """Why a request failed on its own, the engine going on with the others (LLMEngine.fail_request).

    kind: "constraint" (its output constraint failed on the output: the message is for the client)
    or "internal" (processing its output failed: the message is for the log)."""

    kind: str
    message: str


@dataclass(slots=True)
class RequestDelta:
    """What one engine step added to one request. Not frozen: one is built per request and step, and
    a frozen dataclass constructs several times slower."""

    request_id: str
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer
    logprobs: list[TokenLogprobs]  # one per new token when the request asked for logprobs
    # Once finished: "stop", "length", "abort", "transfer" (a prefill-only request) or "error" (see `failure`).
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # With the first output of a request that asked for prompt logprobs: entry i is prompt token i
    # given the tokens before it (None for the first); None otherwise.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    failure: RequestFailure | None = None  # with finish_reason "error": why
    # Prompt tokens the request wrote to the KV store, and of those, under each of its cache hints.
    num_stored_tokens: int = 0
    stored_tokens_by_hint: tuple[int, ...] = ()
    phase_times: RequestPhaseTimes | None = None  # once finished: its queue, prefill and decode here

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result: its completions (one per `n`), and how much of the prompt was cached."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # Prompt tokens the first completion wrote to the KV store, and of those, under each cache hint.
    num_stored_tokens: int = 0
    stored_tokens_by_hint: tuple[int, ...] = ()

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    # The first completion's fields, for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


def output_of(delta: RequestDelta) -> GenerateOutput:
    """The delta as the message that carries it out of the engine's process (to the gateway, or
    from an EP rank to rank 0); a failure travels apart, as the sender decides."""
    return GenerateOutput(
        request_id=delta.request_id,
        token_ids=delta.token_ids,
        text=delta.text or "",
        logprobs=delta.logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        prompt_logprobs=delta.prompt_logprobs,
        num_stored_tokens=delta.num_stored_tokens,
        stored_tokens_by_hint=delta.stored_tokens_by_hint,
        phase_times=delta.phase_times,
    )
