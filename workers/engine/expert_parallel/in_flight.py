"""What rank 0 of an EP engine keeps of each request in flight, so that it can be resubmitted to
another rank after a resize; and the outputs a rank reports, as the engine's deltas."""

from dataclasses import dataclass, field

import msgspec

from workers.engine.outputs import RequestDelta, RequestFailure
from workers.engine.structured.constraint import TokenConstraint
from workers.protocol.engine_request import EngineRequest
from workers.protocol.ep_rank import EPRankReport


@dataclass(slots=True)
class InFlight:
    request: EngineRequest  # as it came
    rank: int  # its rank's place in the group now
    # Rank 0's only: its constraint, compiled once, so a request resubmitted after a re-form goes on
    # with it where it was.
    constraint: TokenConstraint | None = None
    emitted: list[int] = field(default_factory=list)  # tokens streamed so far

    def continued(self) -> EngineRequest:
        """The request as a rank is given it: its prompt followed by what it streamed, for the
        tokens it has left (a greedy stream goes on with the tokens it would have had)."""
        request = self.request
        if not self.emitted:
            return request
        params = request.params
        if params.max_tokens is not None:
            params = msgspec.structs.replace(params, max_tokens=params.max_tokens - len(self.emitted))
        return msgspec.structs.replace(
            request, prompt_token_ids=request.prompt_token_ids + self.emitted, params=params, prompt_logprobs=None
        )

    def record(self, delta: RequestDelta) -> None:
        """Note what `delta` streamed; report the client's prompt, not a continuation's."""
        self.emitted += delta.token_ids
        delta.num_prompt_tokens = len(self.request.prompt_token_ids)
        delta.num_cached_tokens = min(delta.num_cached_tokens, delta.num_prompt_tokens)


def aborted(entry: InFlight, *, has_tokenizer: bool) -> RequestDelta:
    """The last delta of a request aborted on another rank (that rank's own is dropped)."""
    return RequestDelta(
        request_id=entry.request.request_id,
        token_ids=[],
        text="" if has_tokenizer else None,
        logprobs=[],
        finish_reason="abort",
        stop_reason=None,
        num_prompt_tokens=len(entry.request.prompt_token_ids),
        num_cached_tokens=0,
    )


def report_deltas(report: EPRankReport, *, has_tokenizer: bool) -> list[RequestDelta]:
    """A rank's outputs as deltas; a request it refused ends with an internal failure."""
    failures = {f.request_id: RequestFailure(f.kind, f.message) for f in report.failures}
    deltas = [
        RequestDelta(
            request_id=o.request_id,
            token_ids=o.token_ids,
            text=o.text if has_tokenizer else None,
            logprobs=o.logprobs,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            num_prompt_tokens=o.num_prompt_tokens,
            num_cached_tokens=o.num_cached_tokens,
            prompt_logprobs=o.prompt_logprobs,
            failure=failures.get(o.request_id),
            num_stored_tokens=o.num_stored_tokens,
            stored_tokens_by_hint=o.stored_tokens_by_hint,
            phase_times=o.phase_times,
        )
        for o in report.outputs
    ]
    for refused in report.refused:
        deltas.append(
            RequestDelta(
                request_id=refused.request_id,
                token_ids=[],
                text=None,
                logprobs=[],
                finish_reason="error",
                stop_reason=None,
                num_prompt_tokens=0,
                num_cached_tokens=0,
                failure=RequestFailure("internal", f"EP rank {report.rank} refused it: {refused.message}"),
            )
        )
    return deltas
