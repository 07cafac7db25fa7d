"""The interface between the model runner and an attention implementation.

Each step the runner describes its batch once (`StepBatch`); the backend turns that into whatever
metadata its kernels want (`build_metadata`), and every layer then calls the backend with its
queries, its KV cache and that metadata. The runner never looks inside the metadata, and the
model only reads `metadata.slot_mapping` to write new keys and values into the cache.

KV groups (workers.engine.kv.spec): a hybrid model's full-attention layers and each sliding window's
layers keep their KV in pools of their own, so each group has its own block tables and slots. The
runner describes the step once per group (StepBatch's block tables, or its DeviceStepTensors' slots
and tables) and builds one metadata per group; the model's forward receives them per layer
(`layer_metadata`: layer i gets its group's) and hands each attention layer its own, so layer code is
the same for one group or several. A model's forward adapts with one line: iterate
`zip(self.layers, kv_caches, metadata)` and pass the layer's metadata where it passed the step's.

A window replay (workers.engine.kv.window_replay) adds two per-sequence bounds to a group's StepBatch:
`first_keys` (a window group's queries read no key before it) and `first_written` (a full group's
new tokens before it write nothing: slot -1, which `write_kv` and the fused cache write skip). The torch
backends take them from StepBatch; the Triton backend from the runner's DeviceStepTensors (the
first keys of a window group's, the -1 slots of a full group's).

Backends:
- `torch_blockwise`: the reference; plain torch over fixed key blocks, batch-invariant on the CPU.
- `torch_sdpa`: torch's fused scaled_dot_product_attention over gathered pages.
- `triton`: paged Triton kernels (flash-decoding for decode-only steps, a varlen kernel for the
  rest) reading the runner's device tensors; the only one whose decode step can be captured in a
  CUDA graph, because its metadata is tensors of fixed shape and nothing is derived on the host.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True, slots=True)
class DeviceStepTensors:
    """One step's batch layout as device tensors, built by the runner's persistent input batch.

    Sequence b owns query rows `query_start[b]:query_start[b + 1]`. In a CUDA-graph bucket the
    padding sequences have seq_len 0 and their tokens slot -1 (nothing written, nothing read).
    """

    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64, -1 for padding tokens
    seq_lens: torch.Tensor  # [seqs] int32, cached + new tokens after this step
    query_start: torch.Tensor  # [seqs + 1] int32
    block_tables: torch.Tensor  # [seqs, max_pages] int32
    max_query_len: int  # a host number: sizes grids, never read from the device
    decode_only: bool  # every sequence computes exactly one token
    # [seqs] int32 of a window group: each sequence's first readable key (StepBatch.first_keys), 0
    # without a replay; None for a full group. A decode step never needs it: a replay's queries all
    # come before its sampled token, and past them the window starts after the replay's start.
    first_keys: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StepBatch:
    """What the runner knows about a step's sequences, in batch order."""

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    page_size: int
    device: torch.device
    tensors: DeviceStepTensors | None = None  # present when the runner keeps a device input batch
    # Per sequence, a window replay's bounds (workers.engine.kv.window_replay), None without one: the
    # first key its queries may read (a window group's), and the position before which its new tokens
    # write nothing (a full group's: those slots are -1).
    first_keys: list[int] | None = None
    first_written: list[int] | None = None


def layer_metadata(group_metadata: Sequence[Any], group_of_layer: Sequence[int]) -> tuple[Any, ...]:
    """Per layer, the metadata of its KV group (KVCacheSpecs.group_of_layer): what a model's forward takes."""
    return tuple(group_metadata[group] for group in group_of_layer)


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether a decode step built from fixed-address DeviceStepTensors can be replayed as a CUDA graph.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether the backend needs StepBatch.tensors (the runner's device input batch).
    needs_device_tensors: ClassVar[bool] = False
    # Whether it honours StepBatch.first_keys and first_written, which a window replay needs.
    supports_window_replay: ClassVar[bool] = False

    @abstractmethod
    def build_metadata(self, step: StepBatch) -> Any:
        """Per-step metadata shared by every layer; it must expose `slot_mapping` ([tokens] int64)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of each new token ([tokens, heads, head_dim]) over its sequence's cached keys.
        `sinks` ([heads] logits, kernels.attention.sinks) join each row's softmax with no value."""

    def check_model(
        self, *, head_dim: int, dtype: torch.dtype, device: torch.device, value_dim: int | None = None
    ) -> None:
        """Raise ValueError, naming the setting, if this backend cannot serve the model (checked at start).
        `value_dim`: the values' width where it is not the keys' (multi-head latent attention)."""

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.forward(query, k_cache, v_cache, metadata, scale=scale, window=window, sinks=sinks)
