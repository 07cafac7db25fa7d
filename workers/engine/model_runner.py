"""Turns a scheduled step into tensors, runs the model over the paged KV cache, samples.

This is the only engine component that builds tensors. On the CPU it pads every matmul's row
count to at least `min_invariant_rows()`, past the size at which the BLAS switches kernels for
small matrices; together with the blockwise attention backend this makes results batch-invariant.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention import AttentionMetadata, get_backend
from kernels.batch_invariance import min_invariant_rows
from workers.engine.kv_cache import KVCache
from workers.engine.models.llama import DecoderForCausalLM
from workers.engine.sampler import Sampler, SamplingBatch, TokenLogprobs
from workers.engine.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        *,
        attention_backend: str,
        device: torch.device,
        seed: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attend = get_backend(attention_backend)
        self.device = device
        self.min_rows = min_invariant_rows() if device.type == "cpu" else 1
        self.sampler = Sampler(seed=seed)
        self.num_computed_tokens = 0  # tokens run through the model since start: proves prefix hits skip work

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        input_ids = [token for s in scheduled for token in s.token_ids]
        metadata = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in scheduled],
            seq_lens=[s.start_position + len(s.token_ids) for s in scheduled],
            block_tables=[s.block_table for s in scheduled],
            page_size=self.kv_cache.page_size,
            device=self.device,
        )
        num_tokens = len(input_ids)
        padding = max(self.min_rows - num_tokens, 0)
        ids = torch.tensor(input_ids + [0] * padding, dtype=torch.long, device=self.device)
        pos = metadata.positions
        if padding:
            pos = torch.cat([pos, pos.new_zeros(padding)])
        hidden = self.model(ids, pos, self.kv_cache.layers, metadata, self.attend)
        self.num_computed_tokens += num_tokens

        sampling = [(i, s) for i, s in enumerate(scheduled) if s.sample]
        if not sampling:
            return []
        last_rows = [metadata.query_start[i + 1] - 1 for i, _ in sampling]
        rows = last_rows + [last_rows[-1]] * max(self.min_rows - len(last_rows), 0)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])[: len(last_rows)]
        batch = SamplingBatch(
            params=[s.params for _, s in sampling],
            prompt_token_ids=[s.prompt_token_ids for _, s in sampling],
            output_token_ids=[s.output_token_ids for _, s in sampling],
        )
        result = self.sampler(logits, batch)
        return [
            SampledToken(s.request_id, token, logprobs)
            for (_, s), token, logprobs in zip(sampling, result.token_ids, result.logprobs, strict=True)
        ]
