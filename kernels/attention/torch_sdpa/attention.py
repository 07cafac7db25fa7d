"""Paged attention through torch's fused scaled_dot_product_attention.

Each group's keys are gathered from the pages and attended in one call with a boolean mask, the
query heads of a KV head stacked as rows (see row_layout). On the CPU the call is shaped so that
torch's flash kernel computes every row the same way whatever the batch: at least
`min_invariant_rows()` rows per matrix, and keys padded to a multiple of the kernel's fixed key
split (CPU_KEY_SPLIT), so its online softmax visits the same key blocks from position 0 and a
block a row cannot see changes nothing (`kernels.attention.sdpa_is_batch_invariant` checks this
on the running torch). On CUDA, groups of prompts with nothing cached take plain causal attention.

SDPA has no attention sinks (kernels.attention.sinks): with them, a zero key with a zero value is
put before each sequence's keys, and a float mask gives it the sink's logit. It sits at slot 0, so
the real keys keep fixed slots and the kernel's key blocks stay where they are from batch to batch.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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

CPU_KEY_SPLIT = 512  # torch's CPU flash attention splits keys in blocks of this size
# cuDNN's attention builds an execution plan per new shape on the host (milliseconds each), and a
# continuously batched engine sees a new shape almost every step.
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def paged_attention_sdpa(
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
    if query.device.type == "cuda":
        with sdpa_kernel(CUDA_BACKENDS):
            return _attend(query, k_cache, v_cache, metadata, scale, window, sinks)
    return _attend(query, k_cache, v_cache, metadata, scale, window, sinks)


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    kv_heads, _, page_size, _ = k_cache.shape
    on_cpu = query.device.type == "cpu"
    out = attention_output(query, k_cache, v_cache)
    for group in metadata.groups:
        if not on_cpu and window is None and sinks is None and group.fresh and group.first_keys is None:
            _attend_fresh_prompts(query, out, k_cache, v_cache, group, scale)
            continue
        key_multiple = CPU_KEY_SPLIT if on_cpu else page_size
        layout = row_layout(
            group,
            per_kv=query.shape[1] // kv_heads,
            min_rows=min_invariant_rows() if on_cpu else 1,
            key_multiple=key_multiple,
        )
        if sinks is not None:
            result = _attend_with_sinks(query, k_cache, v_cache, group, layout, key_multiple, scale, window, sinks)
            scatter_rows(out, result, group, layout)
            continue
        keys, values = gather_kv(query, k_cache, v_cache, group, layout.num_keys)
        result = F.scaled_dot_product_attention(
            gather_rows(query, group, layout),
            keys,
            values,
            attn_mask=_mask(group, layout, window),
            scale=scale,
        )
        scatter_rows(out, result, group, layout)
    return out


def _attend_with_sinks(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SequenceGroup,
    layout: RowLayout,
    key_multiple: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """The group's rows with a sink key at slot 0 and key j at slot j + 1: [kv_heads, n, rows, head_dim]."""
    # One slot more than the keys, still a whole number of key blocks.
    num_slots = layout.num_keys + (key_multiple if group.max_seq_len == layout.num_keys else 0)
    keys, values = gather_kv(query, k_cache, v_cache, group, num_slots)
    keys = torch.cat([keys.new_zeros(*keys.shape[:2], 1, keys.shape[3]), keys[:, :, :-1]], dim=2)
    values = torch.cat([values.new_zeros(*values.shape[:2], 1, values.shape[3]), values[:, :, :-1]], dim=2)
    kv_heads = k_cache.shape[0]
    head_in_group = torch.arange(layout.rows, device=sinks.device) % layout.per_kv
    row_sinks = sinks.to(query.dtype).view(kv_heads, layout.per_kv)[:, head_in_group]  # [kv, rows]
    mask = _sink_mask(group, layout, num_slots, window, query.dtype).repeat(kv_heads, 1, 1, 1)
    mask[..., 0] = row_sinks[:, None, :]
    return F.scaled_dot_product_attention(gather_rows(query, group, layout), keys, values, attn_mask=mask, scale=scale)


def _sink_mask(
    group: SequenceGroup, layout: RowLayout, num_slots: int, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """[1, n, rows, num_slots]: 0 where a row sees slot j's key (j - 1), -inf elsewhere and at the
    sink's slot 0, which each layer fills with its own sinks; once per step and window."""
    cache_key = ("sdpa_sink_mask", layout.rows, num_slots, window, dtype)
    if cache_key not in group.scratch:
        key_pos = torch.arange(num_slots, device=layout.row_positions.device) - 1
        visible = visible_keys(layout.row_positions, key_pos, group.seq_lens, window)
        visible[:, :, 0] = False
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
        group.scratch[cache_key] = mask.unsqueeze(0)
    return group.scratch[cache_key]


def _attend_fresh_prompts(
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SequenceGroup,
    scale: float,
) -> None:
    """Prompts with nothing cached: plain causal attention, which SDPA runs as a flash kernel.

    Every query starts at position 0, so the causal mask is the same top-left triangle for all;
    a shorter prompt's padding rows and keys lie after its real ones, where no real row looks.
    """
    n, width = group.token_index.shape
    page_size = k_cache.shape[2]
    num_keys = -(-width // page_size) * page_size
    q = query.index_select(0, group.token_index.view(-1)).view(n, width, *query.shape[1:]).transpose(1, 2)
    keys, values = gather_kv(query, k_cache, v_cache, group, num_keys)
    keys, values = keys.transpose(0, 1)[:, :, :width], values.transpose(0, 1)[:, :, :width]
    result = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    result = result.transpose(1, 2).reshape(n * width, *out.shape[1:])
    out.index_copy_(0, group.valid_tokens, result.index_select(0, group.valid_slots))


def _mask(group: SequenceGroup, layout: RowLayout, window: int | None) -> torch.Tensor:
    """[1, n, rows, num_keys] visibility, shared by the KV heads; once per step and window."""
    cache_key = ("sdpa_mask", layout.rows, layout.num_keys, window)
    if cache_key not in group.scratch:
        key_pos = torch.arange(layout.num_keys, device=layout.row_positions.device)
        mask = visible_keys(layout.row_positions, key_pos, group.seq_lens, window, group.first_keys)
        # Padding rows see no key; let them see key 0 so no row is all -inf (NaN in some kernels).
        mask[:, :, 0] |= layout.row_positions < 0
        group.scratch[cache_key] = mask.unsqueeze(0)
    return group.scratch[cache_key]
