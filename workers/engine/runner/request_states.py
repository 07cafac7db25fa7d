"""The model runner's own record of the requests it runs, kept current from each SchedulerOutput.

A request arrives in full once (NewRequestData) and afterwards only as the pages it was given since;
finished, aborted, handed-off and preempted requests are dropped (a preempted one comes back in full).
Per step, `scheduled` pairs each of the step's sequences with its state: what the reference path
and the host-driven sampler read.
"""

from dataclasses import dataclass, field
from typing import Any

from workers.engine.request import PromptImages, WindowReplay, token_slice
from workers.engine.sched.output import SchedulerOutput
from workers.engine.structured.constraint import TokenConstraint
from workers.protocol.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]  # the engine's request's own lists, read only
    output_token_ids: list[int]
    params: SamplingParams
    constraint: TokenConstraint | None
    prompt_logprobs: int | None
    block_ids: list[list[int]]  # per KV-cache group
    window_replay: WindowReplay | None = None  # its windows' replay after its prefix hit
    images: PromptImages | None = None  # a vision-language prompt's images
    # Their embeddings, concatenated, as a tensor on the model's device (the runner builds it once).
    image_embeddings: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, stop)

    @property
    def reports_prompt_logprobs(self) -> bool:
        """Whether the steps computing its prompt report prompt logprobs: until its first output token
        (a recompute after preemption has reported them already)."""
        return self.prompt_logprobs is not None and not self.output_token_ids


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence of a step, with its state: the tokens it computes from `start`, the last of them
    `draft_token_ids` (speculative tokens it verifies, not yet its own)."""

    state: RequestState
    token_ids: list[int]
    start: int
    sample: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token this step reports, or None."""
        return self.state.prompt_logprobs if self.state.reports_prompt_logprobs else None


class RequestStates:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        # How many of them have images: while none has, a step builds no injected embeddings.
        self.num_with_images = 0

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def update(self, output: SchedulerOutput) -> list[str]:
        """Apply a step's changes; the ids of the requests dropped."""
        dropped = [*output.finished_request_ids, *output.preempted]
        for request_id in dropped:
            state = self.states.pop(request_id, None)
            if state is not None and state.images is not None:
                self.num_with_images -= 1
        for new in output.new_requests:
            if new.images is not None:
                self.num_with_images += 1
            self.states[new.request_id] = RequestState(
                request_id=new.request_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=new.output_token_ids,
                params=new.params,
                constraint=new.constraint,
                prompt_logprobs=new.prompt_logprobs,
                block_ids=[list(group) for group in new.block_ids],
                window_replay=new.window_replay,
                images=new.images,
            )
        for request_id, groups in output.new_block_ids.items():
            for table, added in zip(self.states[request_id].block_ids, groups, strict=True):
                table.extend(added)
        return dropped

    def scheduled(self, output: SchedulerOutput) -> list[ScheduledSequence]:
        """The step's sequences with their states and tokens (after update)."""
        sequences = []
        for request_id, count, start, sample in zip(
            output.request_ids, output.num_scheduled_tokens, output.num_computed_tokens, output.sample, strict=True
        ):
            state = self.states[request_id]
            drafts = output.draft_token_ids.get(request_id)
            if drafts:
                tokens = state.token_slice(start, start + count - len(drafts)) + drafts
                sequences.append(ScheduledSequence(state, tokens, start, sample, drafts))
            else:
                sequences.append(ScheduledSequence(state, state.token_slice(start, start + count), start, sample))
        return sequences
