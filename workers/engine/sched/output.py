"""The one message from the scheduler to the model runner: what a step computes.

The runner keeps its own state for every request it runs (workers.engine.runner.request_states), so
a request is described in full once, when it first reaches the runner (NewRequestData: admitted,
resumed after preemption, or continued from a prefill engine), and afterwards only by what changed:
the pages it was given since (per KV-cache group). Per step every scheduled request contributes one
entry to the parallel step lists: how many tokens it computes, from which position, and whether the
step reaches its last token (and so samples the next one).

Block ids are given per KV-cache group: one list per group, in the order of the engine's groups
(workers.engine.kv.spec), each indexed by token position.

Nothing here is a tensor: ids, counts and lists of ints only.
"""

from dataclasses import dataclass, field

from workers.engine.connectors.store import KVLoad
from workers.engine.request import PromptImages, WindowReplay
from workers.engine.structured.constraint import TokenConstraint
from workers.protocol.sampling_params import SamplingParams

# Block ids of one request, one list per KV-cache group.
BlockIds = tuple[list[int], ...]


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner does not hold yet, in full."""

    request_id: str
    # The request's own lists, shared, not copied: the runner reads them (the tokens of a prefill
    # chunk, the history for penalties) and never writes them. An output token sampled on the device
    # and not yet read back is PENDING_TOKEN there.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    constraint: TokenConstraint | None  # masks every sampled token
    # Top alternatives per prompt token when the request asked for prompt logprobs, else None; they
    # are reported by the steps before its first output token.
    prompt_logprobs: int | None
    block_ids: BlockIds  # its pages so far, a copy
    # The replay of its sliding windows after its prefix hit (workers.engine.kv.window_replay), if any.
    window_replay: WindowReplay | None = None
    # A vision-language prompt's images: their embeddings replace its placeholders' (None: a text prompt).
    images: PromptImages | None = None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    # The step's sequences, in batch order, as parallel lists.
    request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # tokens each computes this step
    num_computed_tokens: list[int] = field(default_factory=list)  # tokens each has in its pages before it
    sample: list[bool] = field(default_factory=list)  # whether the step reaches its last token
    # Of those, the requests the runner does not hold yet.
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Of the others, the pages each was given since the runner last heard of it (absent: none).
    new_block_ids: dict[str, BlockIds] = field(default_factory=dict)
    # Of the sampling requests, the draft tokens each verifies after its last token (absent: none);
    # they are the last of its scheduled tokens.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Slots past each scheduled token that its pages already cover (for speculative tokens).
    num_lookahead_tokens: int = 0
    # Requests that lost their pages this step; they come back as new requests.
    preempted: list[str] = field(default_factory=list)
    # Store blocks to copy into pages before the step runs (requests admitted with a store hit).
    loads: list[KVLoad] = field(default_factory=list)
    # Requests that left the scheduler (finished, aborted, handed off) since the last scheduled step:
    # the runner drops them.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids
