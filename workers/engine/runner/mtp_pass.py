"""DeepSeek-V3's multi-token-prediction layer run after each step, for speculative decoding
(--spec-method mtp; the layer is models.mtp.MultiTokenPredictor).

It runs on both of the runner's paths, with the runner's attention backend: the reference path's
torch backends take the step's host lists, and a backend that needs device tensors (Triton, the
device path's) gets them built from the same lists (`device_step_tensors`). The device path runs it
when a step's result reaches the host, as the emitted tokens are known only then.

Its KV: one latent per position, in a tensor of its own with the main cache's pages, so a position's
latent sits at the slot the main model's does and the requests' block tables serve both (the main
cache's groups, store blocks and handoffs are unchanged).

After a step, for every sequence, the layer reads the main model's final hidden state at each of the
step's positions whose next token is now known (a prompt chunk's, or a decode's token and its
accepted drafts) with that next token, writing its latents. A sequence that sampled then drafts K
tokens greedily: the first from its last known position's output, each next one from the previous
output and draft, one query row a step (the draft positions' latents are written over when those
positions are computed for real). Sequences whose KV came from elsewhere (a prefill worker, the
store) have no latents for those positions: their drafts are poorer, never wrong, as verification
keeps the target's tokens.
"""

from collections.abc import Sequence

import numpy as np
import torch

from kernels.attention import NULL_PAGE, AttentionBackend, DeviceStepTensors, StepBatch
from workers.engine.kv.kv_cache import KVCache
from workers.engine.models.mtp import MultiTokenPredictor
from workers.engine.runner.request_states import ScheduledSequence
from workers.engine.spec.drafter import Draft


class MtpPass:
    def __init__(
        self, mtp: MultiTokenPredictor, kv_cache: KVCache, backend: AttentionBackend, *, max_draft_tokens: int
    ) -> None:
        spec = mtp.kv_cache_spec(dtype=kv_cache.specs.groups[0].dtype, page_size=kv_cache.page_size)
        pages = torch.zeros(
            spec.pages_shape(kv_cache.num_pages), dtype=spec.storage_dtype, device=kv_cache.layers[0][0].device
        )
        self.latent = tuple(pages[0].unbind(0))
        self.mtp = mtp
        self.backend = backend
        self.page_size = kv_cache.page_size
        self.max_draft_tokens = max_draft_tokens

    def run(
        self,
        scheduled: Sequence[ScheduledSequence],
        hidden: torch.Tensor,
        query_starts: Sequence[int],
        emitted: dict[str, list[int]],
    ) -> dict[str, Draft]:
        """`hidden`: the main model's final hidden states of the step's rows (sequence i's from
        query_starts[i]); `emitted`: the tokens each sampling sequence emitted (accepted drafts, then
        the sampled one). The drafts of the sequences that sampled, by request id."""
        rows, next_ids, positions, query_lens, seq_lens, tables, last_rows = [], [], [], [], [], [], {}
        for sequence, first_row in zip(scheduled, query_starts, strict=False):
            state = sequence.state
            tokens = emitted.get(state.request_id)
            known = len(sequence.token_ids) - len(sequence.draft_token_ids)
            if tokens is not None:
                known += len(tokens) - 1  # the accepted drafts
                following = [*sequence.token_ids[1:known], tokens[-1]]
            else:  # a prompt chunk that does not end the prompt: the next prompt token follows it
                following = state.token_slice(sequence.start + 1, sequence.start + known + 1)
            rows += range(first_row, first_row + known)
            next_ids += following
            positions += range(sequence.start, sequence.start + known)
            query_lens.append(known)
            seq_lens.append(sequence.start + known)
            tables.append(state.block_ids[0])
            if tokens is not None:
                last_rows[state.request_id] = len(rows) - 1
        device = hidden.device
        out = self._forward(
            hidden[torch.tensor(rows, device=device)], next_ids, positions, query_lens, seq_lens, tables
        )
        return self._chain(out, last_rows, scheduled, seq_lens, tables)

    def _chain(
        self,
        out: torch.Tensor,
        last_rows: dict[str, int],
        scheduled: Sequence[ScheduledSequence],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> dict[str, Draft]:
        """K greedy drafts per sampling sequence, each from the previous one's output."""
        if not last_rows:
            return {}
        index = {sequence.state.request_id: i for i, sequence in enumerate(scheduled)}
        ids = list(last_rows)
        lengths = [seq_lens[index[request_id]] for request_id in ids]
        chain_tables = [tables[index[request_id]] for request_id in ids]
        hidden = out[torch.tensor([last_rows[request_id] for request_id in ids], device=out.device)]
        drafts: dict[str, tuple[list[int], list[float]]] = {request_id: ([], []) for request_id in ids}
        for step in range(self.max_draft_tokens):
            probs = torch.softmax(self.mtp.compute_logits(hidden), dim=-1)
            best, tokens = probs.max(dim=-1)
            for request_id, token, prob in zip(ids, tokens.tolist(), best.tolist(), strict=True):
                drafts[request_id][0].append(token)
                drafts[request_id][1].append(prob)
            if step + 1 == self.max_draft_tokens:
                break
            # The draft just made follows position n + step (n: the sequence's next position - 1 + 1).
            positions = [length + step for length in lengths]
            hidden = self._forward(
                hidden, tokens.tolist(), positions, [1] * len(ids), [p + 1 for p in positions], chain_tables
            )
        return {request_id: Draft(*drafted) for request_id, drafted in drafts.items()}

    def _forward(
        self,
        hidden: torch.Tensor,
        next_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        device = hidden.device
        tensors = (
            device_step_tensors(query_lens, seq_lens, tables, self.page_size, device)
            if self.backend.needs_device_tensors
            else None
        )
        metadata = self.backend.build_metadata(
            StepBatch(
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_tables=tables,
                page_size=self.page_size,
                device=device,
                tensors=tensors,
            )
        )
        return self.mtp(
            hidden,
            torch.tensor(next_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.latent,
            metadata,
            self.backend,
        )


def device_step_tensors(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], page_size: int, device: torch.device
) -> DeviceStepTensors:
    """A step's layout as a device backend reads it, from the host lists: sequence b's query rows
    are the last query_lens[b] of its seq_lens[b] positions, each written at its slot of the block
    table (as the input batch places the main model's), tables padded with NULL_PAGE."""
    query_len = np.asarray(query_lens, dtype=np.int64)
    seq_len = np.asarray(seq_lens, dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum(query_len)])
    seq_of_token = np.repeat(np.arange(len(query_len)), query_len)
    positions = np.arange(query_start[-1]) - query_start[seq_of_token] + (seq_len - query_len)[seq_of_token]
    padded = np.full((len(tables), max(map(len, tables))), NULL_PAGE, dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    slots = padded[seq_of_token, positions // page_size] * page_size + positions % page_size
    return DeviceStepTensors(
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        seq_lens=torch.from_numpy(seq_len).to(device=device, dtype=torch.int32),
        query_start=torch.from_numpy(query_start).to(device=device, dtype=torch.int32),
        block_tables=torch.from_numpy(padded).to(device=device, dtype=torch.int32),
        max_query_len=int(query_len.max()),
        decode_only=bool((query_len == 1).all()),
    )
