"""Paged attention in plain torch over fixed key blocks: the reference backend, batch-invariant.

A query row's output is bitwise the same whatever else is in the batch, however its prompt was
chunked, and whether its token came from prefill or decode. Keys are cut into blocks of a fixed
KEY_BLOCK from position 0 (the last padded and masked), and every reduction has a shape that does
not depend on the batch:
- scores and block-wise softmax numerators are batched matmuls whose reduction lengths are fixed
  (head_dim, KEY_BLOCK) and whose matrices have at least `min_invariant_rows()` rows (see
  row_layout), past the size under which the CPU BLAS switches kernels for small matrices;
- the row maximum over all its keys is exact in any order, and every block's exponentials are
  taken against it;
- the blocks' partial sums are added one after another (cumsum), so all-masked blocks that only
  other sequences need, before or after a row's keys, add exact zeros.
Attention sinks (kernels.attention.sinks) join the row maximum and, after the blocks' sequential
sum, the denominator: the same arithmetic for a row whatever the batch.
Small problems (decode) run as a fixed number of batched ops however many blocks there are; large
ones (prefill) loop over the blocks with the very same arithmetic. Long queries are attended in
row chunks to bound memory; rows are independent, so chunking changes no bit.
"""

import torch

from kernels.attention.sinks import check_sinks
from kernels.attention.torch_common.metadata import (
    AttentionMetadata,
    SequenceGroup,
    attention_output,
    check_paged_inputs,
    gather_kv,
    visible_keys,
)
from kernels.attention.torch_common.row_layout import RowLayout, gather_rows, row_layout, scatter_rows
from kernels.batch_invariance import min_invariant_rows

KEY_BLOCK = 64
ROW_CHUNK = 1024
BATCHED_ELEMENTS = 1 << 22  # above this many intermediate elements, attend block by block


def paged_attention_blockwise(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached keys: [tokens, heads, head_dim]."""
    check_paged_inputs(query, k_cache, v_cache, metadata)
    check_sinks(sinks, heads=query.shape[1], device=query.device)
    if KEY_BLOCK % k_cache.shape[2]:
        raise ValueError(f"page size {k_cache.shape[2]} must divide the key block {KEY_BLOCK}")
    kv_heads, head_dim = k_cache.shape[0], query.shape[2]
    min_rows = min_invariant_rows() if query.device.type == "cpu" else 1
    out = attention_output(query, k_cache, v_cache)
    for group in metadata.groups:
        layout = row_layout(group, per_kv=query.shape[1] // kv_heads, min_rows=min_rows, key_multiple=KEY_BLOCK)
        n, blocks = len(group.seqs), layout.num_keys // KEY_BLOCK
        q = gather_rows(query, group, layout).mul_(scale).unsqueeze(2)  # [kv, n, 1, rows, d]
        keys, values = gather_kv(query, k_cache, v_cache, group, layout.num_keys)
        keys = keys.view(kv_heads, n, blocks, KEY_BLOCK, head_dim)
        values = values.view(kv_heads, n, blocks, KEY_BLOCK, values.shape[-1])
        hidden = _hidden_keys(group, layout, window)
        row_sinks = None if sinks is None else _row_sinks(sinks.to(query.dtype), kv_heads, layout)
        result = torch.cat(
            [
                _attend_rows(
                    q[..., rows, :],
                    keys,
                    values,
                    hidden[..., rows, :],
                    None if row_sinks is None else row_sinks[..., rows, :],
                    group.scratch,
                    ("blocks", layout.rows, window, rows.start),
                )
                for rows in _row_chunks(layout.rows, min_rows)
            ],
            dim=2,
        )
        scatter_rows(out, result, group, layout)
    return out


def _row_sinks(sinks: torch.Tensor, kv_heads: int, layout: RowLayout) -> torch.Tensor:
    """[kv, 1, 1, rows, 1]: each row's sink, that of its query head (rows are (token, head) pairs,
    token-major; padding rows take whatever head their index falls on, and are discarded)."""
    head_in_group = torch.arange(layout.rows, device=sinks.device) % layout.per_kv
    return sinks.view(kv_heads, layout.per_kv)[:, head_in_group].view(kv_heads, 1, 1, layout.rows, 1)


def _attend_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    sinks: torch.Tensor | None,
    scratch: dict,
    cache_key: tuple,
) -> torch.Tensor:
    """q [kv, n, 1, r, d] over keys/values [kv, n, blocks, KEY_BLOCK, d] → [kv, n, r, d]; sinks
    [kv, 1, 1, r, 1] or None.

    Both strategies below do the same arithmetic on every element in the same order, so they
    give the same bits; the choice only trades op count against memory.
    """
    kv, n, blocks, _, head_dim = keys.shape
    if kv * n * blocks * q.shape[3] * (KEY_BLOCK + head_dim) <= BATCHED_ELEMENTS:
        return _attend_all_blocks_at_once(q, keys, values, hidden, sinks)
    if cache_key not in scratch:
        scratch[cache_key] = _block_visibility(hidden)
    return _attend_block_by_block(q, keys, values, hidden, sinks, scratch[cache_key])


def _block_visibility(hidden: torch.Tensor) -> list[tuple[int, bool]]:
    """(block, needs a mask) for the blocks some row of the chunk may see.

    A block no row may see (above a causal diagonal, before a window) would add exact zeros, so
    it is skipped; a block every row sees needs no mask.
    """
    visible = ~hidden[0]  # [n, blocks, r, KEY_BLOCK]
    seen_by_any = visible.flatten(2).any(dim=2).any(dim=0).tolist()
    seen_by_all = visible.flatten(2).all(dim=2).all(dim=0).tolist()
    return [(b, not every) for b, (some, every) in enumerate(zip(seen_by_any, seen_by_all, strict=True)) if some]


def _attend_all_blocks_at_once(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    scores = torch.matmul(q, keys.transpose(-1, -2)).masked_fill_(hidden, float("-inf"))  # [kv, n, b, r, K]
    row_max = scores.amax(dim=(2, 4), keepdim=True)  # [kv, n, 1, r, 1]
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks)
    shift = _finite(row_max)
    probs = torch.exp(scores - shift)
    partial_sums = probs.sum(dim=-1, keepdim=True)  # [kv, n, b, r, 1]
    partial_outputs = torch.matmul(probs, values)  # [kv, n, b, r, d]
    # cumsum adds the blocks in order, one at a time: the last entry is their sequential sum.
    total_sum = partial_sums.cumsum(dim=2)[:, :, -1]
    if sinks is not None:
        total_sum = total_sum + torch.exp(sinks - shift)[:, :, 0]
    return partial_outputs.cumsum(dim=2)[:, :, -1] / total_sum


def _attend_block_by_block(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    sinks: torch.Tensor | None,
    visibility: list[tuple[int, bool]],
) -> torch.Tensor:
    """Two passes over the visible blocks: their scores and the row maximum, then the sums."""
    q = q.squeeze(2)
    scores, live = [], []
    for b, masked in visibility:
        block = torch.matmul(q, keys[:, :, b].transpose(-1, -2))
        scores.append(block.masked_fill_(hidden[:, :, b], float("-inf")) if masked else block)
        live.append(b)
    row_max = scores[0].amax(dim=-1, keepdim=True)
    for block in scores[1:]:
        row_max = torch.maximum(row_max, block.amax(dim=-1, keepdim=True))
    if sinks is not None:
        sinks = sinks.squeeze(2)  # [kv, 1, r, 1]
        row_max = torch.maximum(row_max, sinks)
    shift = _finite(row_max)
    total_sum = total_output = None
    for block, b in zip(scores, live, strict=True):
        probs = torch.exp(block.sub_(shift))
        partial_sum, partial_output = probs.sum(dim=-1, keepdim=True), torch.matmul(probs, values[:, :, b])
        total_sum = partial_sum if total_sum is None else total_sum + partial_sum
        total_output = partial_output if total_output is None else total_output + partial_output
    if sinks is not None:
        total_sum = total_sum + torch.exp(sinks - shift)
    return total_output / total_sum


def _finite(row_max: torch.Tensor) -> torch.Tensor:
    """A row that sees no key (padding) has max -inf; shifting by 0 keeps exp() at 0 instead of NaN."""
    return row_max.masked_fill(row_max == float("-inf"), 0.0)


def _row_chunks(rows: int, min_rows: int) -> list[slice]:
    starts = list(range(0, rows, ROW_CHUNK))
    if len(starts) > 1 and rows - starts[-1] < min_rows:
        starts.pop()  # a last chunk too small to be invariant joins the one before
    return [slice(start, end) for start, end in zip(starts, starts[1:] + [rows], strict=True)]


def _hidden_keys(group: SequenceGroup, layout: RowLayout, window: int | None) -> torch.Tensor:
    """[1, n, blocks, rows, KEY_BLOCK] True where a row may not see a key; once per step and window."""
    cache_key = ("blockwise", layout.rows, window)
    if cache_key not in group.scratch:
        key_pos = torch.arange(layout.num_keys, device=layout.row_positions.device)
        hidden = ~visible_keys(layout.row_positions, key_pos, group.seq_lens, window, group.first_keys)
        n, rows = layout.row_positions.shape
        blocks = layout.num_keys // KEY_BLOCK
        group.scratch[cache_key] = hidden.view(n, rows, blocks, KEY_BLOCK).transpose(1, 2).unsqueeze(0)
    return group.scratch[cache_key]
