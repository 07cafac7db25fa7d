"""The Triton attention backend: its metadata is the runner's device tensors, used as they are.

A decode-only step runs the split-KV decode kernel, any other step the varlen prefill/extend
kernel (decode rows are sequences of one query token there). Nothing is derived on the host, so
a decode step over fixed-address tensors can be captured in a CUDA graph.
"""

from typing import ClassVar

import torch

from kernels.attention.backend import AttentionBackend, DeviceStepTensors, StepBatch
from kernels.attention.triton import check_supported
from kernels.attention.triton.decode import paged_decode_attention
from kernels.attention.triton.prefill import paged_prefill_attention


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs: ClassVar[bool] = True
    needs_device_tensors: ClassVar[bool] = True

    def build_metadata(self, step: StepBatch) -> DeviceStepTensors:
        if step.tensors is None:
            raise ValueError("the triton attention backend needs the runner's device input batch")
        return step.tensors

    def check_model(self, *, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        check_supported(head_dim, dtype)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: DeviceStepTensors,
        *,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if metadata.decode_only:
            return paged_decode_attention(
                query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale=scale, window=window
            )
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start,
            metadata.seq_lens,
            max_query_len=metadata.max_query_len,
            scale=scale,
            window=window,
        )
