"""Turns a scheduled step into tensors, runs the model over the paged KV cache, samples.

Logits are computed for the rows that sample, plus every prompt position of a request that reports
prompt logprobs. Output constraints are asked for their masks here, right before sampling.

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
from workers.engine.sampler import Sampler, SamplingBatch, TokenLogprobs, token_logprobs
from workers.engine.scheduler import ScheduledRequest

# Prompt logprobs are computed this many positions at a time, which bounds the [rows, vocab] logits
# a long prompt chunk would otherwise materialise at once.
PROMPT_LOGITS_ROWS = 256


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens first_index, first_index + 1, ... computed in one step."""

    request_id: str
    first_index: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class StepOutput:
    sampled: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs]


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
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> StepOutput:
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

        prompt_logprobs = [
            self._prompt_logprobs(s, hidden, metadata.query_start[i])
            for i, s in enumerate(scheduled)
            if s.prompt_logprobs is not None
        ]
        sampling = [(i, s) for i, s in enumerate(scheduled) if s.sample]
        if not sampling:
            return StepOutput(sampled=[], prompt_logprobs=prompt_logprobs)
        logits = self._logits(hidden, [metadata.query_start[i + 1] - 1 for i, _ in sampling])
        batch = SamplingBatch(
            params=[s.params for _, s in sampling],
            prompt_token_ids=[s.prompt_token_ids for _, s in sampling],
            output_token_ids=[s.output_token_ids for _, s in sampling],
            allowed_tokens=[s.constraint.allowed_tokens() if s.constraint else None for _, s in sampling],
        )
        result = self.sampler(logits, batch)
        sampled = [
            SampledToken(s.request_id, token, logprobs)
            for (_, s), token, logprobs in zip(sampling, result.token_ids, result.logprobs, strict=True)
        ]
        return StepOutput(sampled=sampled, prompt_logprobs=prompt_logprobs)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of the given hidden rows; padded like the model's matmuls, for batch invariance."""
        padded = rows + [rows[-1]] * max(self.min_rows - len(rows), 0)
        return self.model.compute_logits(hidden[torch.tensor(padded, device=self.device)])[: len(rows)]

    def _prompt_logprobs(self, scheduled: ScheduledRequest, hidden: torch.Tensor, first_row: int) -> PromptLogprobs:
        """Logprobs of the prompt tokens that follow this step's positions: position p's logits
        score prompt token p + 1; the last prompt position's logits are the sampling row."""
        start = scheduled.start_position
        stop = min(start + len(scheduled.token_ids), len(scheduled.prompt_token_ids) - 1)
        entries: list[TokenLogprobs] = []
        for chunk_start in range(start, stop, PROMPT_LOGITS_ROWS):
            chunk_stop = min(chunk_start + PROMPT_LOGITS_ROWS, stop)
            rows = list(range(first_row + chunk_start - start, first_row + chunk_stop - start))
            targets = torch.tensor(scheduled.prompt_token_ids[chunk_start + 1 : chunk_stop + 1], device=self.device)
            num_top = [scheduled.prompt_logprobs] * len(rows)
            entries.extend(token_logprobs(self._logits(hidden, rows), targets, num_top))
        return PromptLogprobs(request_id=scheduled.request_id, first_index=start + 1, entries=entries)
