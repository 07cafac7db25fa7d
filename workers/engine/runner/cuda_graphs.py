"""CUDA graphs of the whole decode step: embedding, layers, logits and sampling, per batch bucket.

Each bucket (a batch size) has a static device buffer in the packed layout of input_batch; a
graph is captured over it once per sampling mode (runner.device_sampling.MODES: "greedy" at start,
the others on first use), largest bucket first, all graphs sharing one memory pool. A step of n
decode requests replays the smallest bucket >= n: its packed inputs (padded with length-0 sequences
that write nothing) are copied into the bucket's buffer in one host-to-device copy, and the graph
leaves the sampled ids (and in "logprobs" mode their logprobs) in static outputs. A cache of several
KV groups has a slot section per group in the packed buffer and a block table per group in each
row: every one of them at a fixed address, so a graph reads each group's as eagerly.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from workers.engine.runner.device_sampling import MODES, SampledLogprobs
from workers.engine.runner.input_batch import InputBatch, PackedLayout, StepInputs, StepPlan
from workers.engine.runner.request_states import RequestStates
from workers.engine.sched.output import SchedulerOutput

StepOutputs = tuple[torch.Tensor, SampledLogprobs | None]  # sampled ids [size], their logprobs


def bucket_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: padding stays under ~12% past 64."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_size + 1, 32))
    sizes = [s for s in sizes if s < max_size]
    return sorted(set(sizes + [max_size]))


@dataclass
class _Bucket:
    size: int
    layout: PackedLayout
    buffer: torch.Tensor  # static device copy of the packed inputs
    graphs: dict[str, torch.cuda.CUDAGraph] = field(default_factory=dict)
    # Per mode, the graph's static outputs.
    outputs: dict[str, StepOutputs] = field(default_factory=dict)


class DecodeGraphs:
    """`forward(inputs, mode)` runs the step eagerly and returns its StepOutputs; capture records it
    per bucket and mode."""

    def __init__(
        self,
        batch: InputBatch,
        forward: Callable[[StepInputs, str], StepOutputs],
        *,
        max_size: int,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.forward = forward
        self.device = device
        self.max_size = max_size
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets = [self._bucket(size) for size in bucket_sizes(max_size)]

    def _bucket(self, size: int) -> _Bucket:
        layout = PackedLayout(size, size, size, self.batch.num_groups)
        return _Bucket(size, layout, torch.zeros(layout.size, dtype=torch.int64, device=self.device))

    def capture(self, modes: Sequence[str] = MODES) -> None:
        for bucket in reversed(self.buckets):
            for mode in modes:
                self._capture(bucket, mode)

    def _capture(self, bucket: _Bucket, mode: str) -> None:
        self.batch.prepare(StepPlan.empty(), SchedulerOutput(), RequestStates(), pad_to=bucket.size, out=bucket.buffer)
        inputs = self.batch.step_inputs(bucket.layout, bucket.buffer, decode_only=True, max_query_len=1)
        self.forward(inputs, mode)  # warm-up: compiles kernels, fills lazy caches, outside the graph
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            inputs = self.batch.step_inputs(bucket.layout, bucket.buffer, decode_only=True, max_query_len=1)
            bucket.outputs[mode] = self.forward(inputs, mode)
        bucket.graphs[mode] = graph

    def fits(self, num_requests: int) -> bool:
        return num_requests <= self.max_size

    def run(self, plan: StepPlan, output: SchedulerOutput, states: RequestStates) -> StepOutputs:
        """Replay a decode step in the plan's mode: its outputs are the graph's static ones, the first
        len(plan.rows) rows of the bucket's."""
        bucket = next(b for b in self.buckets if b.size >= len(plan.rows))
        if plan.mode not in bucket.graphs:
            self._capture(bucket, plan.mode)
        self.batch.prepare(plan, output, states, pad_to=bucket.size, out=bucket.buffer)
        bucket.graphs[plan.mode].replay()
        return bucket.outputs[plan.mode]
