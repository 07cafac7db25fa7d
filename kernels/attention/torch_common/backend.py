"""The torch backends' shared shape: per-step metadata (sequence groups, see metadata) built on the
host, and a paged attention function run over it."""

from collections.abc import Callable
from typing import ClassVar

import torch

from kernels.attention.backend import AttentionBackend, StepBatch
from kernels.attention.torch_common.metadata import AttentionMetadata


class TorchBackend(AttentionBackend):
    attend: ClassVar[Callable[..., torch.Tensor]]
    supports_window_replay = True

    def build_metadata(self, step: StepBatch) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=step.query_lens,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            page_size=step.page_size,
            device=step.device,
            first_keys=step.first_keys,
            first_written=step.first_written,
        )

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return type(self).attend(query, k_cache, v_cache, metadata, scale=scale, window=window, sinks=sinks)
