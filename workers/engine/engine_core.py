"""What an engine reports of itself (EngineStats), whichever kind it is."""

from dataclasses import dataclass

from workers.engine.resumption import ResumeStats
from workers.engine.step_stats import StepStats
from workers.engine.store_connector import StoreStats


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
