"""EngineCore: the one interface of an engine, whichever kind serves behind it: an LLMEngine, or an
EPEngine that runs N expert-parallel ranks and looks like one engine. The worker, its heartbeats and
the offline LLM call only this, and never ask which kind they hold; an operation one kind has no use
for is answered with nothing (a dense engine has no expert load) or refused.

What describes the engine and does not change while it runs is one value, EngineInfo; what it
counts is EngineStats, read at any time (the heartbeats read it from their own thread).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from workers.engine.config import ModelConfig
from workers.engine.connectors.store import StoreStats
from workers.engine.kv.spec import KVCacheSpec
from workers.engine.kv.swa_state import SwaStateSource
from workers.engine.kv.swa_stats import SwaStats
from workers.engine.kv_handoff import KVHandoff
from workers.engine.outputs import RequestDelta
from workers.engine.parallel.placement import Placement
from workers.engine.resumption import ResumeStats
from workers.engine.spec.stats import SpecStats
from workers.engine.step_stats import StepStats
from workers.kvstore.store import KVStore
from workers.protocol.engine_request import EngineRequest
from workers.text.tokenizer import Tokenizer

# The name EngineInfo gives the dtype of weights or KV held as FP8 (e4m3 values, scaled per block or group).


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The model an engine serves and the shape of its KV, as the worker describes it to the rest of
    the system (every rank of an EPEngine is built from the same settings: rank 0's is the group's)."""

    model_name: str
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None: the model was loaded without one (token ids in and out)
    max_model_len: int
    kv_model_id: str  # what decides the bytes of a KV block besides its tokens
    page_size: int  # tokens per KV page
    kv_layout: str  # its KV's layout (KVCacheSpecs.layout): a transfer or pool of another is refused
    kv_block_tokens: int  # tokens per KV store block; 0 without a store
    kv_transfer: str  # how its KV travels to another engine: "auto" (a mapped pool where it can), "zmq" (frames)
    # A sliding-window model's window group, whose SWA state the engine keeps for its store hits
    # (workers.engine.kv.swa_state); None without a store or a single window group.
    swa_state_spec: KVCacheSpec | None = None
    # The dtypes its weights and KV cache are held in, by torch's names (bfloat16, float32...), or
    # workers.engine.dtypes.FP8_E4M3 for e4m3 values with scales beside them (quantization /
    # kv_cache_dtype "fp8").
    weight_dtype: str = ""
    kv_cache_dtype: str = ""


@dataclass(frozen=True, slots=True)
class EPGroupState:
    """The expert-parallel group an engine runs: one rank for an engine without expert parallelism."""

    size: int = 1
    # time.time() of the last re-forming after a rank died, and why; 0.0 and "": never.
    resized_at: float = 0.0
    resize_reason: str = ""


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int
    kv_usage: float
    num_computed_tokens: int  # tokens run through the model since start
    num_prompt_tokens: int  # prompt tokens admitted since start
    num_cached_prompt_tokens: int  # of those, served from the prefix cache
    num_preemptions: int
    store: StoreStats | None  # None when the engine has no KV store
    num_pending_transfers: int = 0  # finished prefill-only requests pinning pages until released
    resume: ResumeStats | None = None  # requests resumed here from a checkpoint; None: none yet
    # (p50, p90) relative error of the cost model's step-time predictions lately; zeros without one.
    cost_model_error: tuple[float, float] = (0.0, 0.0)
    steps: StepStats | None = None  # the engine's step times and tokens since start
    swa: SwaStats | None = None  # a model with sliding-window layers: its SWA state since start
    spec: SpecStats | None = None  # speculative decoding's drafts and acceptance since start; None: off


class EngineCore(ABC):
    info: EngineInfo
    kv_store: KVStore | None  # the global KV block store the engine reads and writes; None without one

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Take a request in, or raise InvalidRequestError naming the problem, or EngineOverloadedError
        when there is no room for it now; either way nothing is changed."""

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Cancel a request: its last delta (finish reason "abort"), or None when it has none to send."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether a step has anything to do."""

    @abstractmethod
    def step(self) -> list[RequestDelta]:
        """Run one step; the deltas of the tokens it sampled."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def export_kv(self, request_id: str) -> KVHandoff:
        """The KV of a request that finished with "transfer", read before release_transfer."""

    @abstractmethod
    def release_transfer(self, request_id: str) -> bool:
        """Unpin a transferred request's pages; False when none were pinned for it."""

    @abstractmethod
    def suspend_for_migration(self, request_id: str) -> RequestDelta | None:
        """Stop decoding a request and pin its KV for export_kv; None when it cannot be now."""

    @abstractmethod
    def resume_suspended(self, request_id: str) -> bool:
        """Undo suspend_for_migration; False when the request is not suspended here."""

    @abstractmethod
    def apply_layout(self, num_logical_experts: int, placement: Placement) -> None:
        """Put an expert placement ([layer][rank][slot] → logical expert) in force before the next
        step, or raise PlacementError saying why not (and nothing changes)."""

    @abstractmethod
    def take_expert_load(self) -> list[list[int]]:
        """Tokens routed to each physical expert slot per MoE layer since the previous take (any
        thread); empty when the engine places no experts."""

    @abstractmethod
    def ep_group(self) -> EPGroupState: ...

    @abstractmethod
    def use_swa_state(self, source: SwaStateSource) -> None:
        """Keep a sliding-window model's SWA state of the blocks it stores in `source` and take store
        hits' from it (a worker's holder, which serves it to other workers); ValueError when the
        engine keeps none (no KV store, no single window group)."""

    @abstractmethod
    def close(self) -> None:
        """Stop: finish writing to the KV store, end any rank processes. The engine is not used again."""
