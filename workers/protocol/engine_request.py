"""EngineRequest: everything an engine needs to take a request in, new or continued, in one struct.

`EngineCore.add_request(EngineRequest)` is the only way into an engine. The worker builds one from
a GenerateRequest, a resumed request from a ResumeDecodeRequest and its checkpoint, the offline LLM
from its prompts; an expert-parallel engine sends the same struct on to the rank that runs it. A new
field is added here, once, instead of to every signature that passes a request on.

`kv` says where the request's KV comes from (the engine's KV connectors): computed here, from the
prompt's cached and stored prefix on; continued from tokens another engine sampled; or handed over
by a prefill engine or a draining decode engine. Torch-free: it crosses process boundaries as
msgpack, and the gateway side may build one without the engine. A handed-over request's KV itself
(host layers, or another engine's pages) does not travel in it: the transfer that brought it puts it
in the engine's handoff connector under the request's id (workers.engine.connectors.handoff).
"""

from typing import Annotated

import msgspec

from workers.protocol.images import ImageEmbeddings
from workers.protocol.messages import MAX_CACHE_HINTS, CacheHint, OutputConstraintSpec
from workers.protocol.sampling_params import SamplingParams


class ComputePrompt(msgspec.Struct, tag="compute", frozen=True, forbid_unknown_fields=True):
    """The prompt's KV is computed here: the local prefix cache and the global store supply what they
    hold of it, the rest is prefilled."""


class ContinueFromTokens(msgspec.Struct, tag="continue", frozen=True, forbid_unknown_fields=True):
    """Another engine decoded this request and was lost: its tokens so far are given, its KV comes from
    the store for every full block stored and is recomputed for the rest, and the next step samples
    the token after `output_token_ids`. The params carry the seed it was sampled with."""

    output_token_ids: list[int]
    # What the client was told about the prompt's cache hits stays what the first engine said.
    num_cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class Prefilled(msgspec.Struct, tag="prefilled", frozen=True, forbid_unknown_fields=True):
    """A prefill engine computed the prompt's KV and sampled `output_token_ids` (its first token);
    the KV waits in this engine's handoff connector, and the next step is a decode."""

    output_token_ids: list[int]
    # Prompt tokens the prefill engine served from a cache: what the client is told.
    num_cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class Migrated(msgspec.Struct, tag="migrated", frozen=True, forbid_unknown_fields=True):
    """A draining decode engine suspended this request between two decode steps and handed it on:
    as Prefilled, with every token it sampled so far."""

    output_token_ids: list[int]
    num_cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


KVSource = ComputePrompt | ContinueFromTokens | Prefilled | Migrated


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: KVSource = ComputePrompt()
    cache_namespace: str = ""
    # Compiled by the engine (workers.engine.structured.grammar) when the request is added.
    constraint: OutputConstraintSpec | None = None
    # Logprobs of the prompt tokens themselves (Completions echo): this many alternatives each.
    prompt_logprobs: int | None = None
    # How long the KV store keeps the blocks this request writes (a TTL policy class).
    traffic_class: str = "chat"
    # End after the first token with finish reason "transfer" and pin the KV for export (a prefill
    # worker's half of a disaggregated request).
    prefill_only: bool = False
    # Whose request this is and its tenant's weight, for the waiting queue's fair share.
    tenant: str = ""
    tenant_weight: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Prefixes of the prompt the client asked the KV store to keep (workers.kvstore.hints).
    cache_hints: Annotated[tuple[CacheHint, ...], msgspec.Meta(max_length=MAX_CACHE_HINTS)] = ()
    # A vision-language model's prompt images, in the order of their placeholders
    # (workers.protocol.images). Every request whose prompt holds placeholders carries them, whatever
    # its KV source: they key its blocks, and a recompute after preemption needs them.
    images: tuple[ImageEmbeddings, ...] = ()
