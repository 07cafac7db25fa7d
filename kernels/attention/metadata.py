"""What an attention kernel needs to know about one step's batch, and helpers shared by backends."""

from dataclasses import dataclass

import torch

NULL_PAGE = 0  # page 0 is never handed out: padded block-table entries point at it
DECODE_QUERY_LEN = 8  # sequences with at most this many new tokens are attended together


@dataclass(frozen=True, slots=True)
class SequenceGroup:
    """Sequences attended in one call, with index tensors that pad them to a common query length."""

    seqs: list[int]
    width: int  # the longest query in the group
    max_seq_len: int
    min_context_start: int  # the earliest query position in the group
    token_index: torch.Tensor  # [n, width] row of each query token in the flattened batch; 0 for padding
    valid: torch.Tensor  # [n, width] bool, False for padding
    positions: torch.Tensor  # [n, width] absolute position of each query token, -1 for padding
    seq_lens: torch.Tensor  # [n]
    block_tables: torch.Tensor  # [n, max_pages]


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
        slot_mapping: list[int],
        device: torch.device,
    ) -> "AttentionMetadata":
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
            raise ValueError("every sequence needs 1 <= query_len <= seq_len")
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        if len(slot_mapping) != query_start[-1]:
            raise ValueError(f"slot_mapping has {len(slot_mapping)} entries for {query_start[-1]} tokens")
        groups = [
            _build_group(seqs, query_lens, seq_lens, query_start, block_tables, device)
            for seqs in _partition(query_lens)
        ]
        return cls(
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start=query_start,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            groups=groups,
        )


def _partition(query_lens: list[int]) -> list[list[int]]:
    """All short-query sequences together, then each longer one alone.

    Batching decode rows amortizes per-call overhead; attending a long prefill alone keeps it from
    padding every decode row up to its query length.
    """
    short = [b for b, q in enumerate(query_lens) if q <= DECODE_QUERY_LEN]
    long = [[b] for b, q in enumerate(query_lens) if q > DECODE_QUERY_LEN]
    return ([short] if short else []) + long


def _build_group(
    seqs: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    query_start: list[int],
    block_tables: list[list[int]],
    device: torch.device,
) -> SequenceGroup:
    width = max(query_lens[b] for b in seqs)
    index, valid, positions = [], [], []
    for b in seqs:
        q, s, start = query_lens[b], seq_lens[b], query_start[b]
        pad = width - q
        index.append(list(range(start, start + q)) + [0] * pad)
        valid.append([True] * q + [False] * pad)
        positions.append(list(range(s - q, s)) + [-1] * pad)
    max_pages = max(len(block_tables[b]) for b in seqs)
    tables = [block_tables[b] + [NULL_PAGE] * (max_pages - len(block_tables[b])) for b in seqs]
    return SequenceGroup(
        seqs=seqs,
        width=width,
        max_seq_len=max(seq_lens[b] for b in seqs),
        min_context_start=min(seq_lens[b] - query_lens[b] for b in seqs),
        token_index=torch.tensor(index, dtype=torch.long, device=device),
        valid=torch.tensor(valid, dtype=torch.bool, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        seq_lens=torch.tensor([seq_lens[b] for b in seqs], dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
    )


def check_paged_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k/v caches must both be [pages, page_size, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if query.shape[2] != k_cache.shape[3] or query.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"query heads/head_dim {tuple(query.shape[1:])} do not fit the cache's {tuple(k_cache.shape[2:])}"
        )
    if query.dtype != k_cache.dtype or query.device != k_cache.device:
        raise ValueError(f"query is {query.dtype} on {query.device}, cache {k_cache.dtype} on {k_cache.device}")
    if query.shape[0] < metadata.num_tokens:
        raise ValueError(f"query has {query.shape[0]} rows for {metadata.num_tokens} scheduled tokens")


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Keys (or values) of each sequence's first `num_keys` slots: [n, kv_heads, num_keys, head_dim].

    `num_keys` must be a multiple of the page size; slots past a sequence's length come from its
    padding pages and must be masked by the caller.
    """
    _, page_size, kv_heads, head_dim = cache.shape
    num_pages = num_keys // page_size
    table = block_tables[:, :num_pages]
    if table.shape[1] < num_pages:
        pad = torch.full(
            (table.shape[0], num_pages - table.shape[1]), NULL_PAGE, dtype=table.dtype, device=table.device
        )
        table = torch.cat([table, pad], dim=1)
    gathered = cache[table]  # [n, num_pages, page_size, kv_heads, head_dim]
    return gathered.reshape(table.shape[0], num_keys, kv_heads, head_dim).transpose(1, 2)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' keys and values ([tokens, kv_heads, head_dim]) at their cache slots."""
    n = slot_mapping.shape[0]
    if key.shape[0] < n or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"keys {tuple(key.shape)} do not fit cache {tuple(k_cache.shape)} for {n} slots")
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key[:n])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value[:n])


def visible_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, seq_lens: torch.Tensor, window: int | None
) -> torch.Tensor:
    """[n, ..., Q, K] True where a query may attend a key: causal, inside its sequence, inside the window."""
    q = query_positions.unsqueeze(-1)
    lens = seq_lens.view(-1, *([1] * (q.dim() - 1)))
    mask = (key_positions <= q) & (key_positions < lens)
    if window is not None:
        mask &= key_positions > q - window
    return mask
