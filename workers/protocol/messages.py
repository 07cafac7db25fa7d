"""Every message that crosses a process boundary between the gateway and engine workers.

msgspec structs, msgpack-encoded; a message's type travels as its tag, so one decoder reads any of
them. This module holds no logic. Names say where a message is in the pipeline: a `...Request`
goes to a worker, an `...Output` comes back for one request, a `Worker...` describes a worker.

Sockets: each worker binds a ROUTER (requests in, outputs out) and a PUB (heartbeats). A gateway
connects one DEALER per worker and a SUB to every worker's PUB. A decode worker also binds a ROUTER,
its transfer endpoint, where prefill workers send KV (see "KV transfer" below).

Disaggregated request path: the gateway sends an ExpectTransferRequest to the decode worker it chose,
then the GenerateRequest, with `decode_endpoint` set to that worker's transfer endpoint, to a prefill
worker. The prefill worker sends the first output (finish_reason "transfer") to the gateway and the
KV to the decode worker, which streams the remaining outputs to the peer that sent the expectation.

A request with images (a vision-language model) names them in GenerateRequest.images; an encode
worker (workers.protocol.encode) sends their embeddings to the worker computing the prompt as
ImageEmbeddingsDelivery messages, and that worker holds the request until they are all there. The KV
handoff carries the embeddings on to the decode worker (KVTransferHeader.images).
"""

from typing import Annotated, Literal

import msgspec

from workers.protocol.images import ImageEmbeddings, ImageEmbeddingsDelivery, ImageRef
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams


class GrammarLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one request's output constraint may cost a worker (workers.engine.structured.grammar). A grammar that
    does not compile within them is refused before any token is generated; one that exceeds them
    while the request runs ends that request alone.

    llguidance compiles lazily: its lexer meets most of a grammar only as the output reaches it, so
    its own limits (the last six fields, its defaults) mostly bite during decoding. The first two
    are ours and apply at admission: a counted repetition unrolls into that many lexer positions,
    and the per-token cost grows with it (SmolLM2's vocabulary: ~0.4 ms at {1000}, 3 ms at {4000},
    80 ms at {50000}, where `(a|aa)*b{50000}` also exhausts the lexer's fuel on its second token).
    """

    # The largest count of a counted repetition ({n}, {m,n}, {n,}) in a pattern, nested counts
    # multiplied.
    max_regex_repeat: Annotated[int, msgspec.Meta(ge=1)] = 1000
    # Wall-clock milliseconds to validate the grammar, build its matcher and compute its first mask.
    max_compile_ms: Annotated[int, msgspec.Meta(ge=1)] = 1000
    # llguidance's LLParserLimits: lexer fuel to build the regexes (~50 per microsecond), lexer
    # fuel per mask (~14 per microsecond), Earley items per mask, branching of one grammar row,
    # lexer states (1-2 kB each), symbols in the grammar.
    initial_lexer_fuel: Annotated[int, msgspec.Meta(ge=1)] = 1_000_000
    step_lexer_fuel: Annotated[int, msgspec.Meta(ge=1)] = 200_000
    step_max_items: Annotated[int, msgspec.Meta(ge=1)] = 50_000
    max_items_in_row: Annotated[int, msgspec.Meta(ge=1)] = 2000
    max_lexer_states: Annotated[int, msgspec.Meta(ge=1)] = 250_000
    max_grammar_size: Annotated[int, msgspec.Meta(ge=1)] = 500_000


# The tags around a tool call in the chat format (recipe.chatml writes them into prompts and parses
# them out of outputs); the "tool_call" kinds' grammars are the text between them.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class OutputConstraintSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the output must match, enforced by a token mask each step (compiled on the worker).

    kind: "json" (schema: compact JSON Schema, or "" for any JSON value), "regex" (schema: the
    pattern), "tool_call" / "tool_call_required" (schema: the tools as a JSON array of Chat
    Completions function tools; "tool_call" also allows plain text instead of a call).
    limits: set by the gateway from its settings, so every worker that compiles the constraint
    (prefill and decode) holds it to the same bounds.
    """

    kind: str
    schema: str
    limits: GrammarLimits = GrammarLimits()


# Cache hints one request may carry: Anthropic allows 4 breakpoints, OpenAI 4 explicit ones besides
# the request's own retention.
MAX_CACHE_HINTS = 8


class CacheHint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A client's ask to keep a prefix of its prompt in the global KV store (an Anthropic
    cache_control breakpoint, an OpenAI prompt_cache_retention of "24h"): the store's full blocks
    within the prompt's first `prefix_tokens` tokens are retained for `retain_s` seconds from this
    request on (workers.kvstore.hints), as far as the worker's caps allow. The GC neither expires a
    retained block nor evicts it while it can evict anything else (workers.kvstore.index)."""

    prefix_tokens: Annotated[int, msgspec.Meta(ge=1)]
    retain_s: Annotated[float, msgspec.Meta(gt=0)]


# Holders of a prefix end's SWA state one request may name: a few workers at most keep the same blocks.
MAX_SWA_HOLDERS = 8
# Images one request may carry, whatever the gateway's SLUICE_MAX_IMAGES allows: a bound on the
# messages a worker or an encoder reads.
MAX_IMAGES_PER_REQUEST = 64


class SwaHolder(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A worker the entrypoint knows as live that holds the SWA state at the end of a request's stored
    prefix (workers.kvstore.holders): its id, as the holder index names it, and its SWA state endpoint
    (WorkerHeartbeat.swa_layers), where the worker computing the request fetches the state."""

    worker_id: Annotated[str, msgspec.Meta(min_length=1)]
    endpoint: Annotated[str, msgspec.Meta(min_length=1)]


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
    # A decode worker's transfer endpoint: prefill only, then send the KV there (the first output
    # ends with finish_reason "transfer"). "": run the whole request here.
    decode_endpoint: str = ""
    # Whose request this is, and its tenant's weight: the engine's waiting queue gives each tenant
    # with requests waiting a share of admissions in proportion to its weight (workers.engine.sched.
    # waiting). Requests without a tenant ("") share one.
    tenant: str = ""
    tenant_weight: Annotated[int, msgspec.Meta(ge=1)] = 1
    # What the client asked the KV store to keep. Only the worker that computes the prompt (mixed or
    # prefill) applies them: a decode worker stores blocks with output tokens in them, which no hint
    # covers.
    cache_hints: Annotated[tuple[CacheHint, ...], msgspec.Meta(max_length=MAX_CACHE_HINTS)] = ()
    # A model with sliding-window layers: the live holders of the SWA state at the end of the prompt's
    # stored prefix, as routing found them (empty: none, or routing did not look). The worker learns
    # where they are from it (workers.worker.swa_peers); it still asks the holder index itself.
    swa_holders: Annotated[tuple[SwaHolder, ...], msgspec.Meta(max_length=MAX_SWA_HOLDERS)] = ()
    # A vision-language model's prompt images, in placeholder order: an encode worker sends their
    # embeddings here (ImageEmbeddingsDelivery), and the request waits for them before it is computed.
    images: Annotated[tuple[ImageRef, ...], msgspec.Meta(max_length=MAX_IMAGES_PER_REQUEST)] = ()


class ExpectTransferRequest(msgspec.Struct, tag="expect_transfer", frozen=True, forbid_unknown_fields=True):
    """To a decode worker: a prefill worker will send this request's KV; stream its outputs to me.
    Aborting the request id drops the expectation; one whose KV never arrives within `timeout_s`
    fails ("transfer_failed")."""

    request_id: str
    # Compiled on arrival (a constraint that does not compile is refused at once, "invalid_constraint")
    # and advanced over the tokens the prefill worker sampled.
    constraint: OutputConstraintSpec | None = None
    # Seconds from arrival: the request's predicted prefill and transfer, with margins
    # (workers.client.prefill_deadlines). 0: the worker's own --transfer-timeout.
    timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    request_id: str


class MigrateRequest(msgspec.Struct, tag="migrate", frozen=True, forbid_unknown_fields=True):
    """To a draining decode worker that offered a request for migration (its output with finish_reason
    "migrate"): send its KV and decoding state to `decode_endpoint`, the transfer endpoint of a decode
    worker told to expect it as `new_request_id`. A failed send ends it with "transfer_failed"."""

    request_id: str
    new_request_id: str
    decode_endpoint: str


class DeclineMigrationRequest(msgspec.Struct, tag="decline_migration", frozen=True, forbid_unknown_fields=True):
    """To a draining decode worker that offered a request for migration: no other decode worker has
    room for it. The worker decodes it on (the stream continues from where it was) and offers it
    again a little later."""

    request_id: str


class ResumeDecodeRequest(msgspec.Struct, tag="resume_decode", frozen=True, forbid_unknown_fields=True):
    """To a decode worker: continue a request whose decode worker died, from its checkpoint and the
    KV store. `request` is the original (its request_id the new one); `output_token_ids` the tokens
    the client already has, which the worker does not send again; `checkpoint_id` the request id the
    dead worker checkpointed it under. A checkpoint that is missing, corrupt or does not match gets
    "checkpoint_invalid" (the gateway then reruns the request from its prompt)."""

    request: GenerateRequest
    output_token_ids: list[int]
    checkpoint_id: str


class DecodingState(msgspec.Struct, tag="decoding_state", frozen=True, forbid_unknown_fields=True):
    """Everything needed to continue a request exactly, checkpointed by its decode worker when it
    takes the request and at each store block boundary (workers.worker.checkpoints).

    The sampler's random state is the seed: a sampled request's draw depends only on its seed and
    the number of tokens sampled so far (an unseeded one is given a seed at admission), and penalty
    counts follow from the token ids. Grammar, stop-string and detokenizer state are rebuilt by
    replaying `output_token_ids` into a fresh matcher and text, as a prefill-to-decode handoff does.
    """

    version: int
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams  # seed included
    cache_namespace: str
    traffic_class: str
    num_cached_tokens: int
    kv_model_id: str


class RequestPhaseTimes(msgspec.Struct, frozen=True, omit_defaults=True):
    """Seconds one request spent in each phase on the worker that sends them (time.monotonic()
    there), with its last output from that worker; None: the phase did not happen there. A prefill
    worker sends queue and prefill (with its "transfer" output), a decode worker decode, a mixed
    worker all three: vLLM's request queue, prefill and decode times."""

    queue_s: float | None = None  # from its arrival to the first step that computed it
    prefill_s: float | None = None  # from that step to its first token, read back from the device
    # From its first token to its last; on a decode worker, from its KV being placed there.
    decode_s: float | None = None


class GenerateOutput(msgspec.Struct, tag="output", frozen=True, omit_defaults=True):
    """What one engine step added to one request; the last one carries finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = []
    # "stop", "length", "abort", or "transfer": a prefill worker's last output, the rest comes from decode;
    # "migrate": a draining decode worker offers the request to another (answer: MigrateRequest).
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Sent once, with the first output, when the request asked for prompt logprobs: entry i is the
    # logprob of prompt token i given the tokens before it (None for the first token).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt tokens this request wrote to the KV store (whole blocks; not those it found there), and
    # of those, the ones kept under each of its cache_hints (a block several hints cover counts for
    # the one that keeps it longest). Known from the first output on, sent by the worker that computed
    # the prompt; a decode worker's outputs leave them out.
    num_stored_tokens: int = 0
    stored_tokens_by_hint: tuple[int, ...] = ()
    # With the request's last output from this worker (see RequestPhaseTimes).
    phase_times: RequestPhaseTimes | None = None


class GenerateError(msgspec.Struct, tag="error", frozen=True):
    """A request the worker could not admit or finish; the last message of its stream. kind:
    - "invalid_request", "overloaded";
    - "invalid_constraint": its output constraint does not compile within its GrammarLimits, or
      exceeded them on the output so far (the message says which); the others run on;
    - "internal": something else about this request failed (processing its output); the others
      run on;
    - "worker_failed": the engine failed as a whole and the worker is exiting; every request it
      held gets this;
    - "draining": the worker takes no new requests: it never started this one, so it is safe to
      send it to another worker;
    - "transfer_failed": the request's KV could not be sent or continued from: its decode part
      never started (or, for a migration, did not continue);
    - "checkpoint_invalid": a ResumeDecodeRequest's checkpoint is missing, corrupt or does not match."""

    request_id: str
    kind: str
    message: str


class HistogramCounts(msgspec.Struct, frozen=True):
    """A histogram since the worker started: counts[i] values were at or below bounds[i] and above
    the bound before it; the last count is of the values above every bound. `total` sums the values."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float


class HandoffTotals(msgspec.Struct, frozen=True):
    """KV handoffs over one transfer backend since the worker started: those completed, their bytes,
    and their seconds summed, each from the start of its transfer to its KV being usable on the
    receiver, or, on the sender, to its last frame handed to the wire or its pages' "done"."""

    num_transfers: int
    num_bytes: int
    seconds: float


class SpecDecodeTotals(msgspec.Struct, frozen=True):
    """Speculative decoding since the worker started (workers.engine.spec.stats): `method` drafts;
    per request and step that verified drafts (a "draft", as vLLM counts), the draft tokens verified
    and accepted, and how often each draft position was accepted; per verify step, the draft tokens
    the batch verified (`budget`); and the drafter's recent calibration error (0: not measured)."""

    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    budget: HistogramCounts
    calibration_error: float = 0.0


# A worker's state, as its heartbeats and control answers say: it takes new requests only when ready;
# draining or drained (it finishes what it has, then idles) after a DrainRequest; stopping after a
# ShutdownRequest.
READY = "ready"
DRAINING = "draining"
DRAINED = "drained"
STOPPING = "stopping"

# How long a worker may send no heartbeat before its clients (gateways) and the registry take it for
# dead: thirty heartbeats at the worker's default interval (workers.worker.args), room for a loaded
# host's late ones.
HEARTBEAT_TIMEOUT_S = 3.0


class SwaTotals(msgspec.Struct, frozen=True):
    """A sliding-window model's SWA state since the worker started (workers.engine.kv.swa_stats):
    prefix hits whose state was in the worker's host cache, fetched from its holder, or missing;
    bounded replays and the tokens they recomputed; bytes the store did not write."""

    state_hits: int = 0
    state_fetches: int = 0
    state_misses: int = 0
    replays: int = 0
    replayed_tokens: int = 0
    store_bytes_not_written: int = 0


class SwaLayers(msgspec.Struct, frozen=True):
    """A worker's model has sliding-window layers: what the entrypoint needs to route a prefix hit the
    way the worker will serve it (workers.kvstore.swa_replay.swa_hit), and where the worker answers
    fetches of the SWA state it keeps (workers.transfer.swa_fetch)."""

    window: Annotated[int, msgspec.Meta(ge=1)]  # tokens a query of a sliding-window layer reads, itself included
    num_layers: Annotated[int, msgspec.Meta(ge=1)]  # the model's sliding-window layers
    replay: Literal["approximate", "exact"]  # the worker's replay mode (swa_replay.REPLAY_MODES)
    # Its SWA state ROUTER, connectable from other hosts; "" when it keeps no state (--swa-state-bytes 0).
    state_endpoint: str = ""


class WorkerHeartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    worker_id: str
    role: str  # "mixed" (prefill and decode in one process), "prefill", "decode" or "encode" (vision)
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
    state: str = READY  # READY, DRAINING, DRAINED or STOPPING
    pool: str = ""
    ttl_policy_version: int = 0
    ep_layout_version: int = 0
    heartbeat_endpoint: str = ""
    hostname: str = ""
    transfer_endpoint: str = ""  # a decode worker's ROUTER for KV transfers
    kv_capacity_tokens: int = 0  # tokens of KV the worker's pages hold
    max_num_seqs: int = 0  # its largest batch
    # How far the fitted step-time model's predictions are off on this worker lately: relative
    # error, median and 90th percentile (zeros when it runs without a cost model).
    cost_model_error_p50: float = 0.0
    cost_model_error_p90: float = 0.0
    # What the entrypoint needs to key a prompt's blocks like this worker does (prefix_match):
    # kv_block_tokens is 0 when the worker has no KV store.
    kv_model_id: str = ""
    kv_block_tokens: int = 0
    # A vision-language model's image placeholder token (None: a text-only model, or a worker that does
    # not say): routing finds each image's first placeholder by it, to key blocks with the image.
    image_token_id: int | None = None
    # The global KV store as this worker's index reads it (zeros without a store). Only the worker that
    # runs the store's GC knows its capacity, watermarks (fractions of it) and eviction totals since
    # the worker started; the others send zeros.
    kv_store_bytes: int = 0
    kv_store_blocks: int = 0
    kv_store_capacity_bytes: int = 0
    kv_store_low_watermark: float = 0.0
    kv_store_high_watermark: float = 0.0
    kv_store_evicted_expired: int = 0
    kv_store_evicted_capacity: int = 0
    # Expert parallelism: the ranks the worker runs as one, and per MoE layer the tokens routed to
    # each physical expert slot since the previous heartbeat, expert_load[layer][rank *
    # slots_per_rank + slot] (the collector sums the windows); empty for dense models.
    ep_size: int = 1
    expert_load: list[list[int]] = []
    # The last time the EP group lost a rank and re-formed with the survivors (0: never): what the
    # control plane records as the resize.
    ep_resized_at: float = 0.0
    ep_resize_reason: str = ""
    # Fault tolerance since the worker started: requests it handed to another decode worker (and
    # those sends that failed, and offers declined for want of room elsewhere), requests it took in
    # that way, requests it resumed from a dead worker's checkpoint; tokens it recomputed for
    # resumed requests (in total, and the most for one); seconds from a resume's arrival to its
    # first new token, in total.
    num_migrated_out: int = 0
    num_migrations_failed: int = 0
    num_migrations_declined: int = 0
    num_migrated_in: int = 0
    num_resumed: int = 0
    num_recomputed_tokens: int = 0
    max_recomputed_tokens: int = 0
    resume_seconds_total: float = 0.0
    # The engine's steps since the worker started: seconds from launching each to reading its result
    # (workers.engine.step_stats says what that covers under async scheduling), and tokens each
    # computed. None from a worker that does not count them.
    step_seconds: HistogramCounts | None = None
    step_tokens: HistogramCounts | None = None
    # KV handoffs since the worker started, by transfer backend ("zmq", "cuda_ipc"): those it sent (a
    # prefill worker's, a draining decode worker's migrations) and those it received.
    handoff_sent: dict[str, HandoffTotals] = {}
    handoff_received: dict[str, HandoffTotals] = {}
    # Fetches from the global KV store since the worker started (zeros without a store): how many,
    # the bytes read, and the seconds they took, summed (reading into host memory, on reader threads).
    num_store_fetches: int = 0
    store_fetch_bytes: int = 0
    store_fetch_seconds: float = 0.0
    # A model with sliding-window layers: what became of its SWA state (None for other models).
    swa: SwaTotals | None = None
    # A worker that decodes speculatively: what its drafts became (None without speculation).
    spec_decode: SpecDecodeTotals | None = None
    # A model with sliding-window layers: its window, replay mode and SWA state endpoint (None for
    # other models). Routing keys its hits with kv_block_tokens and kv_model_id as for any model.
    swa_layers: SwaLayers | None = None
    # The dtypes the worker holds its weights and KV cache in (EngineInfo.weight_dtype, kv_cache_dtype:
    # "bfloat16", "fp8_e4m3"...); "" from a worker that does not say.
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    # An encode worker (role "encode"): vision-tower patches of the requests it holds, patches it has
    # encoded, its embedding cache's lookups, and the patches per second its vision tower measured at
    # its largest batch (the autoscaler's capacity of one encoder; 0 until measured).
    patches_in_flight: int = 0
    num_patches_encoded: int = 0
    embedding_cache_hits: int = 0
    embedding_cache_misses: int = 0
    embedding_cache_bytes: int = 0
    patches_per_second: float = 0.0


# Control plane → worker. Each command carries an id chosen by the sender; a worker answers a
# command id it has seen with the answer it gave then, so a sender may retry after a timeout.
# Sent on the worker's ROUTER like GenerateRequests; answered with one ControlAck.


class DrainRequest(msgspec.Struct, tag="control.drain", frozen=True, forbid_unknown_fields=True):
    """Take no new requests, finish those in flight, then be "drained". With `grace_s`, a decode
    worker streams for that long, then offers every unfinished request for migration to another
    decode worker (GenerateOutput finish_reason "migrate", answered by a MigrateRequest)."""

    command_id: str
    grace_s: Annotated[float, msgspec.Meta(ge=0)] | None = None


class ResumeRequest(msgspec.Struct, tag="control.resume", frozen=True, forbid_unknown_fields=True):
    """A draining or drained worker takes requests again."""

    command_id: str


class ShutdownRequest(msgspec.Struct, tag="control.shutdown", frozen=True, forbid_unknown_fields=True):
    """Abort the requests in flight, acknowledge, then exit with code 0."""

    command_id: str


class SetTTLPolicyRequest(msgspec.Struct, tag="control.set_ttl_policy", frozen=True, forbid_unknown_fields=True):
    command_id: str
    version: int
    policy: dict  # workers.kvstore.ttl.TTLPolicy.to_dict()


class ApplyEPLayoutRequest(msgspec.Struct, tag="control.apply_ep_layout", frozen=True, forbid_unknown_fields=True):
    command_id: str
    version: int
    num_logical_experts: int
    placement: list[list[list[int]]]  # placement[layer][rank][slot] = logical expert id


class StatusRequest(msgspec.Struct, tag="control.status", frozen=True, forbid_unknown_fields=True):
    command_id: str


class ControlAck(msgspec.Struct, tag="control.ack", frozen=True):
    """The answer to one control command: ok, or not and why (message); the worker's state after it."""

    command_id: str
    worker_id: str
    ok: bool
    state: str  # as WorkerHeartbeat.state
    message: str = ""
    ttl_policy_version: int = 0
    ep_layout_version: int = 0
    num_in_flight: int = 0


ControlRequest = (
    DrainRequest | ResumeRequest | ShutdownRequest | SetTTLPolicyRequest | ApplyEPLayoutRequest | StatusRequest
)


# Worker → registry (a DEALER to the control plane's ROUTER): sent at start and re-sent until an
# ok RegistrationAck, so the registry may start after the worker.


class WorkerRegistration(msgspec.Struct, tag="register", frozen=True, kw_only=True, forbid_unknown_fields=True):
    worker_id: str
    pool: str
    role: str
    model: str
    hostname: str
    request_endpoint: str  # connectable from other hosts (a wildcard bind address is replaced)
    heartbeat_endpoint: str
    transfer_endpoint: str = ""  # a decode worker's ROUTER for KV transfers
    ep_size: int = 1
    num_accelerators: int = 0
    accelerator_kind: str = "cpu"  # "cpu" or the accelerator's name, e.g. "NVIDIA H200"
    started_at: float  # as WorkerHeartbeat.started_at


class RegistrationAck(msgspec.Struct, tag="register_ack", frozen=True):
    worker_id: str
    ok: bool
    message: str = ""  # why the registry refused it


WorkerInbound = (
    GenerateRequest
    | ExpectTransferRequest
    | AbortRequest
    | MigrateRequest
    | DeclineMigrationRequest
    | ResumeDecodeRequest
    | ControlRequest
    | ImageEmbeddingsDelivery
)
WorkerOutbound = GenerateOutput | GenerateError | ControlAck


# --- KV transfer (prefill → decode; workers.transfer) ---
# A prefill worker's DEALER sends a request's KV to a decode worker's ROUTER in one of two ways:
# - frames, through host memory (any two hosts): one multipart message per chunk of `chunk_layers`
#   layers, the first [KVTransferHeader, its layers], each later one [KVTransferChunk, its layers]. A
#   layer frame is the raw bytes of a C-order little-endian [planes, heads, num_computed_tokens,
#   width] tensor of `dtype` (keys and values, or a latent: workers.engine.kv.spec): never pickled.
# - a pool offer (two engines of one host): the header alone, its `pool` naming the prefill engine's
#   whole KV cache (mapped once per pool by the decode worker: CUDA IPC between GPU processes, shared
#   memory between CPU ones) and the request's pages in it. The decode worker copies the pages into
#   its own and answers KVTransferReply "done"; the prefill worker keeps its pages until then. A
#   decode worker that cannot map the pool (another host, another page size) answers "frames", and
#   the frames follow, header first.
# A decode worker that refuses or fails a transfer it was offered answers "failed", so that the prefill
# worker releases the pages at once.
# Both name the sender's KV layout (KVCacheSpecs.layout), which a decode worker whose cache is laid out
# otherwise refuses at the header, before any KV is read.


class CudaIpcHandle(msgspec.Struct, tag="cuda_ipc", frozen=True, forbid_unknown_fields=True):
    """torch's CUDA IPC description of the storage a pool's tensor lies in (its _share_cuda_())."""

    device_uuid: str  # the GPU, as every process sees it whatever its CUDA_VISIBLE_DEVICES
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int  # elements from the storage's start to the pool tensor's


class HostMemoryHandle(msgspec.Struct, tag="host_memory", frozen=True, forbid_unknown_fields=True):
    """An anonymous in-memory file (memfd) of the sending process: /proc/<pid>/fd/<fd>."""

    pid: int
    fd: int
    num_bytes: int


class KVPoolOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    exporter: str  # the sending worker: a new pool of it replaces its older ones
    pool_id: str  # one per engine start: a decode worker maps each pool once
    host_id: str  # the sending host's boot id: a pool maps only on the same host (kernel)
    handle: CudaIpcHandle | HostMemoryHandle
    # The pool tensor: [layers, planes, heads, num_pages, page_size, width] of `dtype`, laid out as
    # `kv_layout` says (KVCacheSpecs.layout): a receiver whose cache is laid out otherwise refuses it.
    shape: tuple[int, int, int, int, int, int]
    dtype: str
    kv_layout: str
    pages: list[int]  # the request's pages in the pool, in token order: ceil(num_computed_tokens / page_size)
    # CLOCK_MONOTONIC of the sending host, comparable on the same host: the pages stay pinned until
    # then at least; a copy finished later is not trusted.
    expires_at: float


class KVTransferHeader(msgspec.Struct, tag="kv_header", frozen=True, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled by the prefill worker
    params: SamplingParams
    num_computed_tokens: int  # tokens the KV covers
    num_cached_tokens: int  # prompt tokens the prefill worker served from a cache
    traffic_class: str
    cache_namespace: str
    kv_model_id: str  # model and dtype the KV was computed with
    dtype: str  # "float32", "bfloat16" or "float16"
    kv_layout: str  # the sender's KVCacheSpecs.layout: a receiver whose cache is laid out otherwise refuses it
    layer_shape: tuple[int, int, int, int]  # of every layer frame: [planes, heads, num_computed_tokens, width]
    num_layers: int
    chunk_layers: int  # layers per message; this one carries layers [0, min(chunk_layers, num_layers))
    # Sent by a draining decode worker (a migration), not by a prefill worker.
    migrated: bool = False
    # Set: an offer of the sender's KV pool, and this message carries no layers.
    pool: KVPoolOffer | None = None
    # A vision-language model's prompt images: the receiver keys the prompt's blocks with them, and
    # recomputes the prompt with them after a preemption (workers.protocol.engine_request).
    images: tuple[ImageEmbeddings, ...] = ()


class KVTransferChunk(msgspec.Struct, tag="kv_chunk", frozen=True, forbid_unknown_fields=True):
    """Starts every message of a transfer after the first; they arrive in order."""

    request_id: str
    first_layer: int  # carries layers [first_layer, min(first_layer + chunk_layers, num_layers))


KVTransferMessage = KVTransferHeader | KVTransferChunk

# What a decode worker answers a pool offer, or a transfer it failed.
REPLY_DONE, REPLY_FRAMES, REPLY_FAILED = "done", "frames", "failed"


class KVTransferReply(msgspec.Struct, tag="kv_reply", frozen=True, forbid_unknown_fields=True):
    request_id: str
    action: str  # REPLY_DONE: the pages were copied; REPLY_FRAMES: send them as frames; REPLY_FAILED
    error: str = ""  # why, for REPLY_FAILED and REPLY_FRAMES


# --- SWA state fetch (a worker → the worker holding it; workers.transfer.swa_fetch) ---
# A sliding-window group's KV is not stored globally: the worker that computed a block keeps its SWA
# state in host memory (workers.engine.kv.swa_state) and registers itself as its holder
# (workers.kvstore.holders). A worker that hits a prefix whose state another worker holds sends a
# SwaStateRequest from a DEALER to the holder's SWA state ROUTER, which answers one multipart message:
# [SwaStateReply, one frame per block of `found`, in that order]. A frame is the raw bytes of a C-order
# little-endian run of `dtype` shaped `run_shape` ([layers, planes, heads, block tokens, width]:
# KVCacheSpec.run_shape of the SWA group): never pickled. A block the holder no longer has is named in
# `missing` at once; a receiver that gets no answer by its deadline takes every block as missing. The
# reply names the holder's layout (KVCacheSpec.layout of its SWA group), and a receiver whose SWA group
# is laid out otherwise refuses it.

# Blocks one request may ask for: a window of a few thousand tokens is tens of blocks.
MAX_SWA_STATE_KEYS = 256


class SwaStateRequest(msgspec.Struct, tag="swa_state.request", frozen=True, forbid_unknown_fields=True):
    fetch_id: int  # chosen by the requester, positive; its reply carries it
    keys: list[bytes]  # block keys (workers.kvstore.block_hash), at most MAX_SWA_STATE_KEYS


class SwaStateReply(msgspec.Struct, tag="swa_state.reply", frozen=True, forbid_unknown_fields=True):
    fetch_id: int  # 0: the request could not be read
    kv_layout: str = ""  # the holder's SWA group layout (KVCacheSpec.layout)
    dtype: str = ""  # "float32", "bfloat16" or "float16"
    run_shape: tuple[int, ...] = ()  # of every frame: [layers, planes, heads, block tokens, width]
    found: list[bytes] = []  # keys whose runs follow, one frame each, in this order
    missing: list[bytes] = []  # keys the holder does not hold (any more)
    error: str = ""  # why the request was refused; then nothing else is set
