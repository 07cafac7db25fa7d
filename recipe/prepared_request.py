"""What the gateway gets back for one API request: the engine inputs, and a factory for the object
that turns the engine's outputs into the protocol's response body or stream events."""

import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from recipe.images.resolve import RequestImage
from workers.protocol.encode import EncodeImage
from workers.protocol.messages import CacheHint, GenerateOutput, OutputConstraintSpec
from workers.protocol.sampling_params import SamplingParams

ApiProtocol = Literal["chat.completions", "completions", "responses", "messages"]


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str | None  # the `event:` line; Responses and Anthropic streams name their events, Chat doesn't
    data: str  # the `data:` payload: JSON, or "[DONE]"

    @classmethod
    def of_json(cls, payload: object) -> "SseEvent":
        """An unnamed event carrying `payload` as compact JSON (one line, as SSE data wants)."""
        return cls(None, json.dumps(payload, ensure_ascii=False, separators=(",", ":")))


class ResponseBuilder(typing.Protocol):
    """One response: fed every engine output of every choice, in any interleaving of choices."""

    def push(self, choice: int, output: GenerateOutput) -> list[SseEvent]:
        """The stream events this output produces."""
        ...

    def finish(self) -> list[SseEvent]:
        """After every choice finished: the closing events (usage chunk, [DONE])."""
        ...

    def body(self) -> dict:
        """The non-stream response, once every output was pushed."""
        ...


@dataclass
class PreparedRequest:
    protocol: ApiProtocol
    model: str
    stream: bool
    n: int  # choices; each runs as its own engine request
    prompt_token_ids: list[int]
    constraint: OutputConstraintSpec | None
    prompt_logprobs: int | None  # Completions echo with logprobs: alternatives per prompt token
    # How long the KV store keeps this conversation's blocks: "agent" when it offers tools, else "chat".
    traffic_class: str
    params: SamplingParams = field(repr=False)  # every choice's params, before the per-choice seed
    response_factory: Callable[[str, int], ResponseBuilder] = field(repr=False)
    # The client's cache hints (recipe.cache_hints): prefixes for the KV store to keep, and the key
    # that scopes the cache within the tenant's namespace.
    cache_hints: tuple[CacheHint, ...] = ()
    prompt_cache_key: str | None = None
    # The prompt's images for the encoder, in prompt order (their placeholders are in prompt_token_ids).
    images: tuple[EncodeImage, ...] = ()
    # The same images as read (fetched, decoded), so that the request can be prepared again in
    # another process without fetching them again (controlplane.gateway.prepare_process).
    read_images: tuple[RequestImage, ...] = field(default=(), repr=False)

    def sampling_params(self, choice: int) -> SamplingParams:
        """A seeded request gets seed + choice, so its choices differ but each is reproducible."""
        if self.params.seed is None or choice == 0:
            return self.params
        return msgspec.structs.replace(self.params, seed=self.params.seed + choice)

    def new_response(self, response_id: str, created: int) -> ResponseBuilder:
        return self.response_factory(response_id, created)
