"""Paged decode of multi-head latent attention (DeepSeek-V2/V3 MLA, absorbed form) as one split-KV
Triton kernel, and its wrapper; plus the input checks the MLA prefill wrapper shares.

Absorbed MLA is multi-query attention over one latent head: a token's cache entry is one latent of
Dk = Dv + R values (DeepSeek: the 512-wide compressed KV, then the 64-wide roped key), every query
head is Dk wide (its no-rope part already multiplied by W_UK, then its roped part), and a key's
value is the first Dv values of its own latent. So score = q[:Dv] . c[:Dv] + q[Dv:] . c[Dv:] and
the output, Dv wide per head, is softmax @ c[:, :Dv]. The kernel keeps the two parts apart (a Dv
tile and an R tile per key tile), so nothing is padded to the next power of two of Dk.

`_mla_decode_kernel` computes, for each sequence b, block of BLOCK_H query heads and split s, the
attention of those heads (the rows of every tl.dot, so each latent tile is loaded once for all of
them) over split s of the sequence's keys. A row's keys are cut into `num_splits` splits of
`split_keys(seq_len)` keys each (a multiple of the key tile, at least MIN_SPLIT_KEYS): boundaries
depend only on the row's own length and the split count, never on the batch or the block table's
width, and the workspace stays [B, H, num_splits, Dv] however wide the table is. Grid:
(head_blocks, num_splits, B), head blocks fastest so the programs reading one latent tile run
together and share it through L2. A split holding keys writes its normalized output and its base-2
log-sum-exp to a workspace (in the config's partial dtype); then each program counts its arrival on
the (sequence, head block)'s counter, and the last to arrive merges the non-empty splits in split
order and resets the counter (decode.py's scheme and counters: one launch, replayable from a CUDA graph, two streams
must not run it at once on one device). A padding row (seq_len 0) has no split and writes zeros.

An FP8 latent cache (uint8 rows of kernels.attention.fp8_kv: Dk e4m3 bytes, then a float32 scale per
group) is read through decode.load_rows (FP8=True) for both parts; the values are the first Dv of the
dequantized row, as they are the first Dv bytes of the row.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.fp8_kv import row_bytes
from kernels.attention.triton.decode import (
    DOT_PRECISION,
    LOG2_E,
    MAX_CACHE_HEAD_ELEMENTS,
    SUPPORTED_DTYPES,
    _merge_splits,
    arrival_counters,
    cache_rows,
    load_rows,
)


@dataclass(frozen=True, slots=True)
class MlaDecodeConfig:
    """How the decode kernel cuts its work. A row's result depends on the config (its split lengths,
    the order of its sums), never on the batch: the engine keeps one, DECODE_CONFIG."""

    block_h: int  # query heads per program: the rows of each tl.dot (16 at least, for tensor cores)
    block_n: int  # keys per latent tile
    num_warps: int
    num_stages: int
    num_splits: int  # splits per sequence: more fill the GPU at small batches but write more partials
    partial_dtype: torch.dtype  # of the split partials' workspace, merged in float32


# At DeepSeek-V3's 128 heads this reaches 14% of the copy bandwidth on an H100
# (bench/results/mla_decode_h100.json); bench.mla_decode --sweep times the alternatives, not yet run
# on a GPU. Chosen from compiled sm_90 code (ptxas, bf16, 512 + 64): 16 heads x 32 keys at 8 warps
# and 3 stages take 213 registers and no spill; 4 warps, 64-key tiles, and 32 or 64 heads per
# program spill.
DECODE_CONFIG = MlaDecodeConfig(
    block_h=16, block_n=32, num_warps=8, num_stages=3, num_splits=8, partial_dtype=torch.float32
)


MIN_SPLIT_KEYS = 256  # short rows use fewer, larger splits: a split is never shorter than this
MIN_PART_DIM = 16  # tl.dot's smallest K: the latent's value part and its rope part are each at least this


def check_mla_supported(head_dim: int, value_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError naming the setting when the MLA kernels cannot run this latent layout."""
    rope_dim = head_dim - value_dim
    for name, width in (("value_dim (kv_lora_rank)", value_dim), ("head_dim - value_dim (rope dim)", rope_dim)):
        if width < MIN_PART_DIM or width & (width - 1):
            raise ValueError(
                f"attention_backend='triton' runs MLA when {name} is a power of two >= {MIN_PART_DIM}, "
                f"got {width} (head_dim={head_dim}, value_dim={value_dim})"
            )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention_backend='triton' supports dtypes {[str(d) for d in SUPPORTED_DTYPES]}, not {dtype} "
            f"(MLA head_dim={head_dim}, value_dim={value_dim})"
        )


def check_mla_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    v_dim: int,
) -> None:
    """Checks common to the MLA decode and prefill wrappers; q is [rows, heads, Dk]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, heads, head_dim], got shape {tuple(q.shape)}")
    if latent_cache.dim() != 4 or latent_cache.shape[0] != 1:
        raise ValueError(f"latent_cache must be [1, pages, page_size, head_dim], got {tuple(latent_cache.shape)}")
    _, _, page_size, row_width = latent_cache.shape
    head_dim = q.shape[2]
    fp8 = latent_cache.dtype == torch.uint8
    if row_width != (row_bytes(head_dim) if fp8 else head_dim):
        kind = f"FP8 rows of {row_width} bytes" if fp8 else f"head_dim {row_width}"
        raise ValueError(f"q head_dim {head_dim} does not match the latent cache's {kind}")
    if page_size < 8 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 8, got {page_size}")
    check_mla_supported(head_dim, v_dim, q.dtype)
    if not fp8 and latent_cache.dtype != q.dtype:
        raise ValueError(
            f"q ({q.dtype}) and latent_cache ({latent_cache.dtype}) must share a dtype (or FP8 rows, uint8)"
        )
    for name, index in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if index.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {index.dtype}")
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"block_tables must be [B, max_pages] and seq_lens [B], "
            f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    tensors = {"q": q, "latent_cache": latent_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    if out is not None:
        tensors["out"] = out
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if q.stride(2) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {tuple(q.stride())}")
    if not latent_cache.is_contiguous():
        raise ValueError("latent_cache must be contiguous")
    if latent_cache.numel() >= MAX_CACHE_HEAD_ELEMENTS:
        raise ValueError(f"the latent cache holds {latent_cache.numel()} elements, over the kernels' int32 offsets")
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables' last dim must be contiguous, got strides {tuple(block_tables.stride())}")
    out_shape = (*q.shape[:2], v_dim)
    if out is not None and (tuple(out.shape) != out_shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(
            f"out must be {out_shape} in {q.dtype} with its last dim contiguous, "
            f"got {tuple(out.shape)}, {out.dtype}, strides {tuple(out.stride())}"
        )


def paged_mla_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    v_dim: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: MlaDecodeConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each sequence's last token over its cached latents: [B, H, v_dim] in query's dtype.

    query: [B, H, Dk], the query at position seq_lens[b] - 1 (its latent already in the cache);
    latent_cache: [1, pages, page_size, Dk], values are each latent's first v_dim entries;
    block_tables: [B, max_pages] int32; seq_lens: [B] int32, 0 for a padding row (its output is
    zeros). config: how the kernel cuts the work (default: DECODE_CONFIG).
    """
    check_mla_inputs(query, latent_cache, block_tables, seq_lens, out, v_dim)
    if query.shape[0] != block_tables.shape[0]:
        raise ValueError(f"query has {query.shape[0]} rows for {block_tables.shape[0]} sequences")
    batch, heads, head_dim = query.shape
    config = config or DECODE_CONFIG
    if config.num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {config.num_splits}")
    num_splits = config.num_splits
    _, _, page_size, _ = latent_cache.shape
    out = torch.empty(batch, heads, v_dim, dtype=query.dtype, device=query.device) if out is None else out
    if batch == 0:
        return out
    head_blocks = triton.cdiv(heads, config.block_h)
    part_out = torch.empty(batch, heads, num_splits, v_dim, dtype=config.partial_dtype, device=query.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=query.device)
    _mla_decode_kernel[(head_blocks, num_splits, batch)](
        query,
        latent_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        arrival_counters(query.device, batch * head_blocks),
        out,
        scale * LOG2_E,
        heads,
        block_tables.shape[1],
        query.stride(0),
        query.stride(1),
        latent_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=config.block_h,
        V_DIM=v_dim,
        ROPE_DIM=head_dim - v_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        MIN_SPLIT=MIN_SPLIT_KEYS,
        **cache_rows(latent_cache, head_dim),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    out_ptr,
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    heads_total,
    max_pages,
    stride_qb,
    stride_qh,
    stride_cp,
    stride_bt,
    stride_ob,
    stride_oh,
    BLOCK_H: tl.constexpr,
    V_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    FP8: tl.constexpr,  # the cache holds FP8 rows (decode.load_rows)
    ROW: tl.constexpr,  # elements of one cached row: Dk, or an FP8 row's bytes
    SCALE_GROUP: tl.constexpr,
):
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)

    seq_len = tl.load(seq_lens_ptr + b)
    num_keys = tl.minimum(seq_len, max_pages * PAGE_SIZE)  # never read past the block table
    # This row's split length: its own keys shared over the splits, whole tiles, at least MIN_SPLIT.
    per_split = tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
    per_split = tl.maximum(per_split, MIN_SPLIT)
    end_split = tl.cdiv(num_keys, per_split)  # splits past it hold no key and write nothing

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = heads < heads_total
    v_dims = tl.arange(0, V_DIM)
    part = (b * heads_total + heads).to(tl.int64) * num_splits  # each row's first split in the workspace
    if split < end_split:
        _attend_latent_split(
            q_ptr + b.to(tl.int64) * stride_qb,
            cache_ptr,
            block_tables_ptr + b.to(tl.int64) * stride_bt,
            part_out_ptr,
            part_lse_ptr,
            part + split,
            heads,
            row_ok,
            split * per_split,
            tl.minimum((split + 1) * per_split, num_keys),
            scale_log2,
            stride_qh,
            stride_cp,
            BLOCK_H,
            V_DIM,
            ROPE_DIM,
            PAGE_SIZE,
            BLOCK_N,
            FP8,
            ROW,
            SCALE_GROUP,
        )

    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    counter = arrivals_ptr + b * tl.num_programs(0) + head_block
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(counter, 0)  # all splits have arrived: zero again for the next launch
        _merge_splits(
            part_out_ptr,
            part_lse_ptr,
            part,
            0,
            end_split,
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + v_dims[None, :],
            part_lse_ptr,  # no sinks: never read
            row_ok,
            v_dims,
            BLOCK_H,
            V_DIM,
            False,
        )


@triton.jit
def _attend_latent_split(
    q_ptr,
    cache_ptr,
    table,
    part_out_ptr,
    part_lse_ptr,
    part,
    heads,
    row_ok,
    start,
    end,
    scale_log2,
    stride_qh,
    stride_cp,
    BLOCK_H: tl.constexpr,
    V_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    ROW: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
):
    """Online softmax of the block's heads over keys [start, end); stores the normalized partial
    output and its base-2 log-sum-exp at workspace row `part`."""
    head_dim: tl.constexpr = V_DIM + ROPE_DIM
    v_dims = tl.arange(0, V_DIM)
    r_dims = V_DIM + tl.arange(0, ROPE_DIM)
    q_rows = q_ptr + heads[:, None] * stride_qh
    q_nope = tl.load(q_rows + v_dims[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows + r_dims[None, :], mask=row_ok[:, None], other=0.0)
    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, V_DIM], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        visible = keys < end
        pages = tl.load(table + keys // PAGE_SIZE, mask=visible, other=0)
        row_starts = pages * stride_cp + (keys % PAGE_SIZE) * ROW
        latent = load_rows(cache_ptr, row_starts, v_dims, visible, head_dim, SCALE_GROUP, FP8).to(q_nope.dtype)
        k_rope = load_rows(cache_ptr, row_starts, r_dims, visible, head_dim, SCALE_GROUP, FP8).to(q_rope.dtype)
        scores = tl.dot(q_nope, tl.trans(latent), input_precision=DOT_PRECISION)
        scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision=DOT_PRECISION)
        scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        row_max = new_max

    has_keys = row_sum > 0  # every split holds at least one key, so this holds for every real row
    row_sum = tl.where(has_keys, row_sum, 1.0)
    tl.store(part_lse_ptr + part, tl.where(has_keys, row_max + tl.log2(row_sum), float("-inf")), mask=row_ok)
    partial = acc / row_sum[:, None]
    tl.store(
        part_out_ptr + part[:, None] * V_DIM + v_dims[None, :],
        partial.to(part_out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
