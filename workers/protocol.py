"""Every message that crosses a process boundary between the gateway and engine workers.

msgspec structs, msgpack-encoded; a message's type travels as its tag, so one decoder reads any of
them. This module holds no logic. Names say where a message is in the pipeline: a `...Request`
goes to a worker, an `...Output` comes back for one request, a `Worker...` describes a worker.

Sockets: each worker binds a ROUTER (requests in, outputs out) and a PUB (heartbeats). A gateway
connects one DEALER per worker and a SUB to every worker's PUB.
"""

import msgspec

from workers.engine.sampler import TokenLogprobs
from workers.engine.sampling_params import SamplingParams


class OutputConstraintSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the output must match, enforced by a token mask each step (compiled on the worker).

    kind: "json" (schema: compact JSON Schema, or "" for any JSON value), "regex" (schema: the
    pattern), "tool_call" / "tool_call_required" (schema: the tools as a JSON array of Chat
    Completions function tools; "tool_call" also allows plain text instead of a call).
    """

    kind: str
    schema: str


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_namespace: str = ""
    constraint: OutputConstraintSpec | None = None
    # Logprobs of the prompt tokens themselves (Completions echo): this many alternatives each.
    prompt_logprobs: int | None = None
    # How long the KV store keeps the blocks this request writes (a TTL policy class: "chat", "agent").
    traffic_class: str = "chat"


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    request_id: str


class GenerateOutput(msgspec.Struct, tag="output", frozen=True, omit_defaults=True):
    """What one engine step added to one request; the last one carries finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = []
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Sent once, with the first output, when the request asked for prompt logprobs: entry i is the
    # logprob of prompt token i given the tokens before it (None for the first token).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class GenerateError(msgspec.Struct, tag="error", frozen=True):
    """A request the worker could not admit or finish. kind: "invalid_request", "overloaded",
    "internal"."""

    request_id: str
    kind: str
    message: str


class WorkerHeartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    worker_id: str
    role: str  # "mixed" (prefill and decode in one process); "prefill" / "decode" later
    model: str
    request_endpoint: str
    max_model_len: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_pages: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_preemptions: int
    sent_at: float  # time.time() on the worker
    # time.time() when the worker process started: a new value means it restarted and lost the
    # requests it had in flight.
    started_at: float = 0.0
    # The global KV store, when the worker has one: prompt tokens it served, blocks moved.
    num_store_hit_tokens: int = 0
    num_store_blocks_read: int = 0
    num_store_blocks_written: int = 0


WorkerInbound = GenerateRequest | AbortRequest
WorkerOutbound = GenerateOutput | GenerateError
