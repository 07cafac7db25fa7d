"""The Triton attention backend: its metadata is the runner's device tensors, used as they are.

A decode-only step runs the split-KV decode kernel, any other step the varlen prefill/extend
kernel (decode rows are sequences of one query token there). Nothing is derived on the host, so
a decode step over fixed-address tensors can be captured in a CUDA graph.

Multi-head latent attention (DeepSeek's MLA, absorbed) comes in as a value cache narrower than the
key cache: k_cache is the layer's latent plane [1, pages, page_size, Dk] and v_cache its first Dv
columns (a view of the same memory). Those calls go to the MLA kernels, which read the latent once.
"""

from typing import ClassVar

import torch

from kernels.attention.backend import AttentionBackend, DeviceStepTensors, StepBatch
from kernels.attention.triton import check_supported
from kernels.attention.triton.decode import paged_decode_attention
from kernels.attention.triton.mla_decode import check_mla_supported, paged_mla_decode
from kernels.attention.triton.mla_prefill import paged_mla_prefill
from kernels.attention.triton.prefill import paged_prefill_attention


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs: ClassVar[bool] = True
    needs_device_tensors: ClassVar[bool] = True
    supports_window_replay: ClassVar[bool] = True

    def build_metadata(self, step: StepBatch) -> DeviceStepTensors:
        if step.tensors is None:
            raise ValueError("the triton attention backend needs the runner's device input batch")
        return step.tensors

    def check_model(
        self, *, head_dim: int, dtype: torch.dtype, device: torch.device, value_dim: int | None = None
    ) -> None:
        """value_dim: a value narrower than head_dim (MLA's kv_lora_rank, head_dim its latent width)."""
        if value_dim is None or value_dim == head_dim:
            check_supported(head_dim, dtype)
        else:
            check_mla_supported(head_dim, value_dim, dtype)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: DeviceStepTensors,
        *,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if v_cache.shape[-1] != k_cache.shape[-1]:
            if sinks is not None:
                raise ValueError("the triton MLA kernels have no attention sinks")
            return self._forward_mla(query, k_cache, v_cache, metadata, scale=scale, window=window)
        if metadata.decode_only:
            return paged_decode_attention(
                query,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale=scale,
                window=window,
                sinks=sinks,
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
            sinks=sinks,
            first_keys=metadata.first_keys,
        )

    def _forward_mla(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        value_view: torch.Tensor,
        metadata: DeviceStepTensors,
        *,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        check_latent_value_view(latent_cache, value_view)
        if window is not None:
            raise ValueError(f"the triton MLA kernels have no sliding window, got window={window}")
        v_dim = value_view.shape[-1]
        if metadata.decode_only:
            return paged_mla_decode(
                query, latent_cache, metadata.block_tables, metadata.seq_lens, v_dim=v_dim, scale=scale
            )
        return paged_mla_prefill(
            query,
            latent_cache,
            metadata.block_tables,
            metadata.query_start,
            metadata.seq_lens,
            max_query_len=metadata.max_query_len,
            v_dim=v_dim,
            scale=scale,
        )


def check_latent_value_view(latent_cache: torch.Tensor, value_view: torch.Tensor) -> None:
    """MLA's value cache must be the latent cache's leading columns: the kernels read values from the latent."""
    if latent_cache.dim() != 4 or latent_cache.shape[0] != 1:
        raise ValueError(
            f"a value cache narrower than the key cache means MLA, whose latent cache is [1, pages, page_size, "
            f"head_dim]; got k_cache {tuple(latent_cache.shape)}"
        )
    leading_columns = (
        value_view.data_ptr() == latent_cache.data_ptr()
        and value_view.shape[:-1] == latent_cache.shape[:-1]
        and value_view.shape[-1] < latent_cache.shape[-1]
        and value_view.stride() == latent_cache.stride()
    )
    if not leading_columns:
        raise ValueError(
            f"MLA's v_cache must be k_cache[..., :v_dim] (a view of the latent cache), got v_cache "
            f"{tuple(value_view.shape)} strides {tuple(value_view.stride())} for k_cache {tuple(latent_cache.shape)} "
            f"strides {tuple(latent_cache.stride())}"
        )
