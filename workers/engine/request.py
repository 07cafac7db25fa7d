"""A request's state inside the engine: tokens, progress, pages."""

import enum
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workers.engine.structured.constraint import TokenConstraint
from workers.kvstore.block_hash import (
    ROOT_HASH,
    BlockHash,
    hash_chain,
    image_block_extra,
    image_digest,
    image_hash_chain,
    image_placeholders,
)
from workers.kvstore.hints import BlockRetention
from workers.protocol.images import ImageEmbeddings
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams

# The value an output token holds while it is sampled on the device but not yet read back (async
# scheduling): the next step's input takes the real id from the device.
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class WindowReplay:
    """A request's replay: positions [start, end) recomputed for its windows after a hit of `end` tokens."""

    start: int
    end: int
    exact: bool


@dataclass(frozen=True, slots=True, eq=False)
class PromptImages:
    """A prompt's images (checked: workers.protocol.images.check_images) and where they go:
    `positions` are the prompt positions of every placeholder, image after image, so row j of the
    images' concatenated embeddings belongs at positions[j]. An image's digest enters the key
    extra of the block where its first placeholder lies and of every block after it."""

    embeddings: tuple[ImageEmbeddings, ...]
    positions: np.ndarray  # int64 [placeholders], ascending
    starts: tuple[int, ...]  # each image's first placeholder position
    digests: tuple[bytes, ...]  # each image's content hash, as a fixed-size digest

    @classmethod
    def of(cls, prompt: Sequence[int], image_token_id: int, images: Sequence[ImageEmbeddings]) -> "PromptImages":
        positions, starts = image_placeholders(prompt, image_token_id, [image.num_tokens for image in images])
        return cls(
            embeddings=tuple(images),
            positions=positions,
            starts=starts,
            digests=tuple(image_digest(image.content_hash) for image in images),
        )

    def block_extra(self, base: bytes, index: int, block_size: int) -> bytes:
        """The key extra of block `index` of `block_size` tokens (block_hash.image_block_extra)."""
        return image_block_extra(base, self.starts, self.digests, index, block_size)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller
    # A prefill-only request computed its prompt and sampled its first token: its KV waits, pinned,
    # for export to a decode engine (LLMEngine.export_kv).
    TRANSFER = "transfer"
    # The request failed on its own (its constraint, its output processing): LLMEngine.fail_request.
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    There is no separate prefill/decode state: `num_computed_tokens` catches up with `num_tokens`
    step by step; a step that reaches the end samples one more token. A preempted request simply
    restarts from zero computed tokens, keeping its output, and its prefix pages are usually
    still cached.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    # Folded into every page hash: separates models and tenants' cache namespaces.
    hash_extra: bytes
    # The tenant's cache namespace folded into hash_extra; a KV handoff carries it to the decode engine.
    cache_namespace: str = ""
    # Stop after the first sampled token and keep the KV for a decode engine (FinishReason.TRANSFER).
    prefill_only: bool = False
    # Whose request it is and that tenant's weight: the waiting queue admits tenants by fair share.
    tenant: str = ""
    tenant_weight: int = 1
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    # Decides how long the global KV store keeps the blocks this request writes ("chat", "agent").
    traffic_class: str = "chat"
    # Prompt tokens served from the prefix cache or the KV store at the request's first admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    pages: list[int] = field(default_factory=list)
    # How many of `pages` the model runner has been told of; -1 while it does not hold the request
    # (before its first step, and again after preemption), when it is described in full.
    num_pages_sent: int = -1
    # A vision-language model's prompt images; None for a text prompt.
    images: PromptImages | None = None
    # Speculative tokens the scheduled step verifies after the request's last token (spec.speculator);
    # they are not its tokens: the step's verification keeps those the model agrees with.
    draft_token_ids: list[int] = field(default_factory=list)
    # Hashes of the request's full pages, in order; the chain continues from the last.
    page_hashes: list[BlockHash] = field(default_factory=list)
    # The replay of its sliding windows after its prefix hit, if it needed one (kv.window_replay).
    window_replay: WindowReplay | None = None
    # The request's keys in the global KV store (blocks of its tokens), extended as blocks fill.
    store_keys: list[BlockHash] = field(default_factory=list)
    # Blocks from the start that are in the store or queued for it; they survive preemption.
    num_saved_blocks: int = 0
    # How the store keeps the leading blocks the client's cache hints cover (workers.kvstore.hints),
    # planned at admission; what this request wrote to the store of its prompt, in tokens, and of
    # that, under each hint (reported in its outputs).
    retention: tuple[BlockRetention, ...] = ()
    num_stored_prompt_tokens: int = 0
    stored_tokens_by_hint: tuple[int, ...] = ()
    # The prompt's partial last block is in the store or queued for it, or needs no storing
    # (StoreConnector.store_prompt_tail).
    prompt_tail_stored: bool = False
    # Store blocks being fetched for the prompt (a Future of connectors.store.LoadedBlocks); the
    # request is admitted once it is done.
    store_fetch: "Future[Any] | None" = None
    # Masks every sampled token; its state follows output_token_ids, so it survives preemption.
    constraint: TokenConstraint | None = None
    # Top alternatives per prompt token when the caller asked for prompt logprobs, else None.
    prompt_logprobs: int | None = None
    # Entry i: prompt token i given the tokens before it (None for the first); filled during prefill.
    prompt_token_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # A request resumed here from another engine's checkpoint (a ContinueFromTokens EngineRequest):
    # time.monotonic() of the resume until its first new token (0 otherwise), the tokens it had then,
    # and the cached prompt tokens the first engine reported, which its outputs keep reporting.
    resumed_at: float = 0.0
    resumed_tokens: int = 0
    reported_cached_tokens: int = 0
    # Its phases here (time.monotonic(); 0: not yet), reported with its last output: when this engine
    # took it in to wait (0 for a request continued from another engine's prefill, which never waits
    # here), when a step first computed it, and when its first token here was read back (for a
    # continued request: when it was taken in, as its decoding starts then).
    queued_at: float = 0.0
    scheduled_at: float = 0.0
    first_token_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def has_pending_token(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but a pending one)."""
        return self.num_tokens - self.has_pending_token

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, stop)

    @property
    def needs_prompt_logits(self) -> bool:
        """Every prompt position must run through the model (no prefix hits) to report prompt
        logprobs; once the first token is out they have been reported."""
        return self.prompt_logprobs is not None and not self.output_token_ids

    def record_prompt_logprobs(self, first_index: int, entries: list[TokenLogprobs]) -> None:
        """Store the logprobs of prompt tokens first_index, first_index + 1, ... (a recompute after
        preemption overwrites the same entries)."""
        if not self.prompt_token_logprobs:
            self.prompt_token_logprobs = [None] * len(self.prompt_token_ids)
        self.prompt_token_logprobs[first_index : first_index + len(entries)] = entries

    @property
    def is_fetching(self) -> bool:
        return self.store_fetch is not None and not self.store_fetch.done()

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def reset_for_recompute(self) -> None:
        """After preemption: forget the pages; the tokens (output included) are computed again."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.pages = []
        self.num_pages_sent = -1
        self.draft_token_ids = []
        self.page_hashes = []
        self.window_replay = None
        self.num_preemptions += 1

    def block_extra(self, index: int, block_size: int) -> bytes:
        """The key extra of the request's block `index` (blocks of `block_size` tokens): its namespace,
        and the images that start in it or before it."""
        if self.images is None:
            return self.hash_extra
        return self.images.block_extra(self.hash_extra, index, block_size)

    def block_keys(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        parent: BlockHash = ROOT_HASH,
        first_block: int = 0,
        max_blocks: int | None = None,
    ) -> list[BlockHash]:
        """The chained keys of the full blocks of `tokens`, the request's tokens from block
        `first_block` on (its key chain continuing from `parent`)."""
        if self.images is None:
            return hash_chain(tokens, block_size, self.hash_extra, parent=parent, max_blocks=max_blocks)
        return image_hash_chain(
            tokens,
            block_size,
            self.hash_extra,
            self.images.starts,
            self.images.digests,
            parent=parent,
            first_block=first_block,
            max_blocks=max_blocks,
        )

    @property
    def num_reusable_tokens(self) -> int:
        """Computed tokens whose KV may be keyed for reuse (prefix cache, store): all, except after an
        approximate window replay, from whose end on the KV is approximate."""
        replay = self.window_replay
        if replay is not None and not replay.exact:
            return min(self.num_computed_tokens, replay.end)
        return self.num_computed_tokens


def token_slice(prompt: list[int], output: list[int], start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of prompt + output, without building the whole list."""
    prompt_len = len(prompt)
    if stop <= prompt_len:
        return prompt[start:stop]
    if start >= prompt_len:
        return output[start - prompt_len : stop - prompt_len]
    return prompt[start:] + output[: stop - prompt_len]
