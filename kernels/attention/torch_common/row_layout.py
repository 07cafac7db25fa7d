"""Queries laid out as rows of per-KV-head matrices, shared by the torch backends.

Each KV head attends one matrix of query rows: every (token, query head sharing that KV head)
pair, token-major. Grouped-query attention thus needs no repeated keys, and a decode step's few
rows can be padded with zero rows to the minimum row count that keeps CPU matmuls batch-invariant.
A layout is derived once per step and reused by every layer.
"""

from dataclasses import dataclass

import torch

from kernels.attention.torch_common.metadata import SequenceGroup


@dataclass(frozen=True, slots=True)
class RowLayout:
    width: int  # query tokens per sequence (the group's longest query)
    per_kv: int  # query heads per KV head
    rows: int  # width * per_kv, padded with zero rows up to the minimum row count
    num_keys: int  # keys per sequence after padding to the backend's key multiple
    row_positions: torch.Tensor  # [n, rows] absolute position of each row's token, -1 for padding


def row_layout(group: SequenceGroup, *, per_kv: int, min_rows: int, key_multiple: int) -> RowLayout:
    cache_key = ("rows", per_kv, min_rows, key_multiple)
    if cache_key in group.scratch:
        return group.scratch[cache_key]
    n, width = group.positions.shape
    rows = max(width * per_kv, min_rows)
    positions = group.positions.repeat_interleave(per_kv, dim=1)
    if rows > width * per_kv:
        positions = torch.cat([positions, positions.new_full((n, rows - width * per_kv), -1)], dim=1)
    layout = RowLayout(
        width=width,
        per_kv=per_kv,
        rows=rows,
        num_keys=-(-group.max_seq_len // key_multiple) * key_multiple,
        row_positions=positions,
    )
    group.scratch[cache_key] = layout
    return layout


def gather_rows(query: torch.Tensor, group: SequenceGroup, layout: RowLayout) -> torch.Tensor:
    """[tokens, heads, head_dim] → [kv_heads, n, rows, head_dim]."""
    n, head_dim = len(group.seqs), query.shape[2]
    kv_heads = query.shape[1] // layout.per_kv
    q = query.index_select(0, group.token_index.view(-1)).view(n, layout.width, kv_heads, layout.per_kv, head_dim)
    q = q.permute(2, 0, 1, 3, 4).reshape(kv_heads, n, layout.width * layout.per_kv, head_dim)
    if layout.rows > layout.width * layout.per_kv:
        q = torch.cat([q, q.new_zeros(kv_heads, n, layout.rows - layout.width * layout.per_kv, head_dim)], dim=2)
    return q


def scatter_rows(out: torch.Tensor, result: torch.Tensor, group: SequenceGroup, layout: RowLayout) -> None:
    """Write [kv_heads, n, rows, head_dim] results back to their tokens' rows of `out`."""
    kv_heads, n, _, head_dim = result.shape
    result = result[:, :, : layout.width * layout.per_kv].reshape(kv_heads, n, layout.width, layout.per_kv, head_dim)
    result = result.permute(1, 2, 0, 3, 4).reshape(n * layout.width, kv_heads * layout.per_kv, head_dim)
    out.index_copy_(0, group.valid_tokens, result.index_select(0, group.valid_slots))
