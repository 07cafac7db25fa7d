"""What the torch backends need to know about one step's batch (its sequences in groups, built on the
host), and the helpers both of them use."""

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kernels.attention.fp8_kv import dequantize_rows, row_bytes
from kernels.attention.paged import NULL_PAGE, is_fp8

DECODE_QUERY_LEN = 8  # sequences with at most this many new tokens are attended together
PREFILL_PADDING_RATIO = 1.25  # a longer query groups with others at most this much longer
# Padded query tokens per prefill group: bounds the CPU reference's memory; on CUDA fewer, larger
# groups mean fewer launches.
PREFILL_GROUP_TOKENS = {"cpu": 4096, "cuda": 65536}


@dataclass(frozen=True, slots=True)
class SequenceGroup:
    """Sequences attended in one call, with index tensors that pad them to a common query length."""

    seqs: list[int]
    width: int  # the longest query in the group
    max_seq_len: int
    min_context_start: int  # the earliest query position in the group
    fresh: bool  # every sequence's query starts at position 0 (nothing cached before it)
    token_index: torch.Tensor  # [n, width] row of each query token in the flattened batch; 0 for padding
    valid_slots: torch.Tensor  # flat indices into [n * width] of the real (non-padding) entries
    valid_tokens: torch.Tensor  # their rows in the flattened batch, in the same order
    positions: torch.Tensor  # [n, width] absolute position of each query token, -1 for padding
    seq_lens: torch.Tensor  # [n]
    block_tables: torch.Tensor  # [n, max_pages]
    first_keys: torch.Tensor | None  # [n] the first key each sequence's queries may read; None: 0
    # Per-step values a backend derives once and reuses in every layer (masks, padded positions).
    scratch: dict[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step batch layout, built once by the model runner and shared by every layer.

    Queries of all sequences are concatenated along the token dimension in batch order; sequence
    `b` owns rows `query_start[b]:query_start[b + 1]`. Rows past `num_tokens` are padding and
    belong to no sequence.
    """

    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens in context per sequence after this step (cached + new)
    query_start: list[int]  # len B + 1 prefix sums of query_lens
    positions: torch.Tensor  # [num_tokens] int64 absolute position of each new token
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot (page * page_size + offset) per new token
    groups: list[SequenceGroup]

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device,
        first_keys: list[int] | None = None,
        first_written: list[int] | None = None,
    ) -> "AttentionMetadata":
        """Vectorised over tokens: a step may schedule tens of thousands of them. `first_keys` and
        `first_written`: see kernels.attention.backend.StepBatch."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        if q_lens.size == 0 or (q_lens < 1).any() or (q_lens > s_lens).any():
            raise ValueError("every sequence needs 1 <= query_len <= seq_len")
        tables = _padded_tables(block_tables)
        if (tables.shape[1] * page_size < s_lens).any():
            raise ValueError("a block table has fewer pages than its sequence needs")
        query_start = np.concatenate([[0], np.cumsum(q_lens)])
        seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.arange(query_start[-1]) - query_start[seq_of_token] + (s_lens - q_lens)[seq_of_token]
        slots = tables[seq_of_token, positions // page_size] * page_size + positions % page_size
        if first_written is not None:
            slots = np.where(positions < np.asarray(first_written)[seq_of_token], -1, slots)
        starts = np.asarray(first_keys, dtype=np.int64) if first_keys is not None else None
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            query_start=query_start.tolist(),
            positions=torch.from_numpy(positions).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            groups=[
                _build_group(seqs, q_lens, s_lens, query_start, tables, starts, device)
                for seqs in _partition(query_lens, PREFILL_GROUP_TOKENS.get(device.type, PREFILL_GROUP_TOKENS["cpu"]))
            ],
        )


def _padded_tables(block_tables: list[list[int]]) -> np.ndarray:
    max_pages = max(len(table) for table in block_tables)
    tables = np.full((len(block_tables), max_pages), NULL_PAGE, dtype=np.int64)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = table
    return tables


def _partition(query_lens: list[int], max_group_tokens: int) -> list[list[int]]:
    """All short-query sequences together, then longer ones in groups of similar query length.

    Batching amortizes per-call overhead; grouping by length keeps padding small, so a long prefill
    never pads every decode row up to its query length. Which group a sequence lands in never
    changes its results: backends compute each row independently of the others.
    """
    short = [b for b, q in enumerate(query_lens) if q <= DECODE_QUERY_LEN]
    groups = [short] if short else []
    long = sorted((b for b, q in enumerate(query_lens) if q > DECODE_QUERY_LEN), key=lambda b: -query_lens[b])
    for b in long:
        group = groups[-1] if groups and groups[-1] is not short else None
        if (
            group is not None
            and query_lens[b] * PREFILL_PADDING_RATIO >= query_lens[group[0]]
            and query_lens[group[0]] * (len(group) + 1) <= max_group_tokens
        ):
            group.append(b)
        else:
            groups.append([b])
    return groups


def _build_group(
    seqs: list[int],
    q_lens: np.ndarray,
    s_lens: np.ndarray,
    query_start: np.ndarray,
    tables: np.ndarray,
    first_keys: np.ndarray | None,
    device: torch.device,
) -> SequenceGroup:
    index = np.asarray(seqs)
    q, s, start = q_lens[index], s_lens[index], query_start[index]
    width = int(q.max())
    column = np.arange(width)
    valid = column[None, :] < q[:, None]
    token_index = np.where(valid, start[:, None] + column[None, :], 0)
    positions = np.where(valid, (s - q)[:, None] + column[None, :], -1)
    valid_slots = np.flatnonzero(valid)
    return SequenceGroup(
        seqs=seqs,
        width=width,
        max_seq_len=int(s.max()),
        min_context_start=int((s - q).min()),
        fresh=bool((s == q).all()),
        token_index=torch.from_numpy(token_index).to(device),
        valid_slots=torch.from_numpy(valid_slots).to(device),
        valid_tokens=torch.from_numpy(token_index.reshape(-1)[valid_slots]).to(device),
        positions=torch.from_numpy(positions).to(device),
        seq_lens=torch.from_numpy(s.copy()).to(device),
        block_tables=torch.from_numpy(tables[index]).to(device),
        first_keys=torch.from_numpy(first_keys[index]).to(device) if first_keys is not None else None,
    )


def attention_output(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Zeros for every query row's output: [tokens, heads, value width]."""
    return query.new_zeros(*query.shape[:2], kv_widths(query, k_cache, v_cache)[1])


def kv_widths(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(key width, value width) in values. An FP8 cache's rows (kernels.attention.fp8_kv) are wider
    than the query's head; MLA's value cache is the leading columns of its latent rows, and the first
    v bytes of an FP8 row are its first v values, so the value view's width is the values' either way."""
    if not is_fp8(k_cache):
        return k_cache.shape[3], v_cache.shape[3]
    key_width = query.shape[2]
    return key_width, key_width if v_cache.shape[3] == k_cache.shape[3] else v_cache.shape[3]


def check_paged_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got shape {tuple(query.shape)}")
    # Values may be narrower than keys: multi-head latent attention's values are the leading columns
    # of its one latent head.
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k/v caches must both be [kv_heads, pages, page_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    fp8 = is_fp8(k_cache)
    row_width = row_bytes(query.shape[2]) if fp8 else query.shape[2]
    if row_width != k_cache.shape[3] or query.shape[1] % k_cache.shape[0]:
        raise ValueError(
            f"query heads/head_dim {tuple(query.shape[1:])} do not fit the cache's "
            f"{k_cache.shape[0]} kv heads of rows of {k_cache.shape[3]}{' FP8 bytes' if fp8 else ''}"
        )
    if fp8 and v_cache.dtype != torch.uint8:
        raise ValueError(f"an FP8 key cache needs an FP8 value cache, got {v_cache.dtype}")
    if (not fp8 and query.dtype != k_cache.dtype) or query.device != k_cache.device:
        raise ValueError(f"query is {query.dtype} on {query.device}, cache {k_cache.dtype} on {k_cache.device}")
    if query.shape[0] < metadata.num_tokens:
        raise ValueError(f"query has {query.shape[0]} rows for {metadata.num_tokens} scheduled tokens")


def gather_pages(cache: torch.Tensor, group: SequenceGroup, num_keys: int) -> torch.Tensor:
    """Keys (or values) of each sequence's first `num_keys` slots: [kv_heads, n, num_keys, head_dim].

    Contiguous, so each (kv head, sequence) matrix feeds a batched matmul without another copy.
    `num_keys` must be a multiple of the page size; slots past a sequence's length come from its
    padding pages and must be masked by the caller.
    """
    kv_heads, _, page_size, head_dim = cache.shape
    pages = _flat_page_table(group, num_keys // page_size)
    gathered = cache.index_select(1, pages)  # [kv_heads, n * num_pages, page_size, head_dim]
    return gathered.view(kv_heads, len(group.seqs), num_keys, head_dim)


def gather_kv(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: SequenceGroup, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_pages of the keys and of the values, in the query's dtype: an FP8 cache's rows are
    dequantized here, after the gather, so only the group's pages are converted. MLA's values are
    the leading columns of its dequantized latent."""
    if not is_fp8(k_cache):
        return gather_pages(k_cache, group, num_keys), gather_pages(v_cache, group, num_keys)
    key_width, value_width = kv_widths(query, k_cache, v_cache)
    keys = dequantize_rows(gather_pages(k_cache, group, num_keys), key_width, query.dtype)
    if v_cache.shape[3] != k_cache.shape[3]:
        return keys, keys[..., :value_width].contiguous()
    return keys, dequantize_rows(gather_pages(v_cache, group, num_keys), key_width, query.dtype)


def _flat_page_table(group: SequenceGroup, num_pages: int) -> torch.Tensor:
    """The group's block tables cut or NULL_PAGE-padded to `num_pages`, flattened; once per step."""
    cache_key = ("pages", num_pages)
    if cache_key not in group.scratch:
        table = group.block_tables[:, :num_pages]
        if table.shape[1] < num_pages:
            pad = table.new_full((table.shape[0], num_pages - table.shape[1]), NULL_PAGE)
            table = torch.cat([table, pad], dim=1)
        group.scratch[cache_key] = table.reshape(-1)
    return group.scratch[cache_key]


def visible_keys(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    first_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n, ..., Q, K] True where a query may attend a key: causal, inside its sequence, inside the
    window, from its sequence's first readable key on."""
    q = query_positions.unsqueeze(-1)
    lens = seq_lens.view(-1, *([1] * (q.dim() - 1)))
    mask = (key_positions <= q) & (key_positions < lens)
    if window is not None:
        mask &= key_positions > q - window
    if first_keys is not None:
        mask &= key_positions >= first_keys.view_as(lens)
    return mask
