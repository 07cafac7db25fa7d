"""What the engine's steps took, counted in fixed buckets since the engine started, for the worker's
heartbeats: per step, the seconds from launching it to reading its result, and the tokens it computed.

Those seconds are the step's device time only when steps run one after another. With async
scheduling a step's result is read during the next engine call, after the next step was scheduled
and launched, and its launch may queue behind the device's work on the step before: its seconds
then also cover that, so they are the step's latency as the engine sees it (an upper bound of its
device time), and consecutive steps' intervals overlap.
"""

from bisect import bisect_left

# A decode step of a small model takes a few hundred microseconds on a GPU, a long prefill on a CPU
# seconds.
STEP_SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's iteration_tokens_total buckets (its CUDA-graph batch sizes and token budgets).
STEP_TOKENS_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Buckets:
    """counts[i]: values at or below bounds[i] and above the bound before it; the last count, values
    above every bound (Prometheus's `le` buckets, not yet cumulative)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class StepStats:
    def __init__(self) -> None:
        self.seconds = Buckets(STEP_SECONDS_BOUNDS)
        self.tokens = Buckets(STEP_TOKENS_BOUNDS)

    @property
    def num_steps(self) -> int:
        return sum(self.seconds.counts)

    def record(self, seconds: float, num_tokens: int) -> None:
        self.seconds.observe(seconds)
        self.tokens.observe(num_tokens)
