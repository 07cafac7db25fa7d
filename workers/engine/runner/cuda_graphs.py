"""CUDA graphs of whole steps: embedding, layers, logits, sampling (and verification), per bucket.

Two kinds, sharing one memory pool:
- Decode graphs: each bucket a batch size n, n sequences of one token that each sample once; a step
  of n decode requests replays the smallest bucket >= n.
- Verify graphs (speculative decoding): each bucket a total token count t; every sequence computes
  its last token and its drafts and samples at each (runner.verify.accept_on_device picks what it
  emits), so t tokens are t samples, in at most min(t, batch rows) sequences, each at most
  1 + max drafts long (the attention grid's query length). A step that verifies t tokens replays
  the smallest bucket >= t.

Each bucket has a static device buffer in the packed layout of input_batch; a graph is captured over
it once per sampling mode (runner.device_sampling.MODES), on first use or ahead (`capture`), largest
bucket first. A step's packed inputs, padded to the bucket (InputBatch._fill_padding: padding writes
nothing and reads nothing), are copied into the bucket's buffer in one host-to-device copy, and the
graph leaves the sampled ids (and in "logprobs" mode their logprobs) in static outputs. A cache of
several KV groups has a slot section per group in the packed buffer and a block table per group in
each row: every one of them at a fixed address, so a graph reads each group's as eagerly.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from workers.engine.runner.device_sampling import MODES, SampledLogprobs
from workers.engine.runner.input_batch import InputBatch, PackedLayout, StepInputs, StepPlan
from workers.engine.runner.request_states import RequestStates
from workers.engine.sched.output import SchedulerOutput

StepOutputs = tuple[torch.Tensor, SampledLogprobs | None]  # sampled ids [samples], their logprobs


def bucket_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: padding stays under ~12% past 64."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_size + 1, 32))
    sizes = [s for s in sizes if s < max_size]
    return sorted(set(sizes + [max_size]))


def decode_layouts(max_rows: int, num_groups: int) -> list[PackedLayout]:
    return [PackedLayout(size, size, size, num_groups) for size in bucket_sizes(max_rows)]


def verify_layouts(max_rows: int, max_draft_tokens: int, num_groups: int) -> list[PackedLayout]:
    """From 2 tokens (one sequence, one draft) to every row verifying the most drafts."""
    sizes = [t for t in bucket_sizes(max_rows * (max_draft_tokens + 1)) if t >= 2]
    return [PackedLayout(t, min(t, max_rows), t, num_groups) for t in sizes]


@dataclass
class _Bucket:
    layout: PackedLayout
    buffer: torch.Tensor  # static device copy of the packed inputs
    graphs: dict[str, torch.cuda.CUDAGraph] = field(default_factory=dict)
    # Per mode, the graph's static outputs.
    outputs: dict[str, StepOutputs] = field(default_factory=dict)


class StepGraphs:
    """`forward(inputs, mode)` runs the step eagerly and returns its StepOutputs; capture records it
    per bucket and mode. `decode_only` and `max_query_len` are the attention metadata every bucket's
    steps share."""

    def __init__(
        self,
        batch: InputBatch,
        forward: Callable[[StepInputs, str], StepOutputs],
        layouts: Sequence[PackedLayout],
        *,
        decode_only: bool,
        max_query_len: int,
        device: torch.device,
        pool: tuple[int, int],
    ) -> None:
        self.batch = batch
        self.forward = forward
        self.decode_only = decode_only
        self.max_query_len = max_query_len
        self.pool = pool
        self.buckets = [
            _Bucket(layout, torch.zeros(layout.size, dtype=torch.int64, device=device)) for layout in layouts
        ]

    def capture(self, modes: Sequence[str] = MODES) -> None:
        for bucket in reversed(self.buckets):
            for mode in modes:
                self._capture(bucket, mode)

    def _inputs(self, bucket: _Bucket) -> StepInputs:
        return self.batch.step_inputs(
            bucket.layout, bucket.buffer, decode_only=self.decode_only, max_query_len=self.max_query_len
        )

    def _capture(self, bucket: _Bucket, mode: str) -> None:
        empty = StepPlan.empty()
        self.batch.prepare(empty, SchedulerOutput(), RequestStates(), pad_to=bucket.layout, out=bucket.buffer)
        self.forward(self._inputs(bucket), mode)  # warm-up: compiles kernels, fills lazy caches, outside the graph
        torch.cuda.synchronize(bucket.buffer.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.outputs[mode] = self.forward(self._inputs(bucket), mode)
        bucket.graphs[mode] = graph

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1].layout.tokens

    def run(self, plan: StepPlan, output: SchedulerOutput, states: RequestStates) -> StepOutputs:
        """Replay a step in the plan's mode: its outputs are the graph's static ones, the first
        plan.num_samples rows of the bucket's."""
        bucket = next(b for b in self.buckets if b.layout.tokens >= plan.num_tokens)
        if plan.mode not in bucket.graphs:
            self._capture(bucket, plan.mode)
        self.batch.prepare(plan, output, states, pad_to=bucket.layout, out=bucket.buffer)
        bucket.graphs[plan.mode].replay()
        return bucket.outputs[plan.mode]
