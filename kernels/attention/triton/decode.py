"""Paged decode attention (one query per sequence) as one split-KV Triton kernel, and its wrapper.

`_decode_kernel` computes, for each sequence b, kv head and split s, softmax attention of the kv
head's query heads (its GQA group, packed as the rows of one tile so each K/V tile is loaded once
for the group) over the keys in positions [s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS) that the query at
`seq_lens[b] - 1` sees. Grid: (B, kv_heads, num_splits). Each split that holds a visible key writes
its normalized output and its log-sum-exp (base 2) to an fp32 workspace; splits with none (past
the sequence's end, before its window, or a padding row with seq_len 0) write nothing. Then the
program counts its arrival on the (sequence, kv head)'s int32 counter (an acq_rel atomic add,
after a barrier so every thread's stores come first); the program that arrives last merges the
visible splits in split order, weighted by exp2(lse - max), writes the output (zeros for a row
with no key) and resets the counter to 0. So a decode attention is one launch, and the counters
are zero again whenever no launch is running: the kernel replays from a CUDA graph. The counters
are a persistent per-device workspace shared by every layer, whose launches are stream-ordered;
two streams must not run this kernel at once on one device.

Attention sinks (kernels.attention.sinks, one logit per query head) join once, in the merge: the
sink's logit is one more log-sum-exp with a zero output.

A group of two or more heads multiplies with tl.dot, its rows padded to 16; a lone head (no GQA)
with a broadcast multiply-sum. With a window, key tiles before the query's window are skipped and
the boundary tile is masked.

The split count is cdiv(max_pages * page_size, SPLIT_KEYS): shapes only, never lengths, so the
launch reads no tensor values and can be captured in a CUDA graph (the split count is a runtime
argument, so a new table width does not compile a new kernel). Split boundaries sit at fixed key
positions and the merge visits only the splits that hold visible keys, always in the same order,
so a row's result does not depend on how wide the batch's block table is nor on which program
arrives last.

An FP8 cache (uint8 rows of kernels.attention.fp8_kv) is read by `load_rows` (FP8=True): each
row's e4m3 bytes through a float8e4nv pointer, its float32 scales at byte `HEAD_DIM` of the row
through a float32 pointer, value = e4m3 * scale in fp32, rounded to q's dtype: the values the torch
backends dequantize to, so the math after the load is the same as for a bf16 cache. Where a row has
one scale (heads of 64 and 128), the decode kernel instead takes each row's e4m3 values as they are
and applies the scales to what they multiply: a key's scale to its scores, a value's to its
probabilities, before the value product. With bf16 or fp16 queries the products take fp16 operands
(`fp16_queries`, `fp16_probabilities`): e4m3 converts to fp16 exactly in one instruction per two
values, and the values are converted before their change of layout (`e4m3_to_fp16_as_loaded`), so a
value tile moves to its dot operand by ldmatrix, not a byte at a time. Each program of an FP8 cache
reads a longer split (`decode_config`), since its rows are half as many bytes. Results differ from
the dequantized values' by rounding only, and are closer to fp32 attention than bf16 operands'.

The input checks shared with the prefill wrapper (`check_supported`, `check_paged_inputs`,
`sinks_log2`, `cache_rows`) live here too.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.fp8_kv import row_bytes, scale_group
from kernels.attention.sinks import check_sinks
from kernels.device import compiled_capability
from kernels.pdl import launch_options, pdl_prologue

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Keys per split; a multiple of every key tile below. bench.decode_attention on one H200 (SmolLM2 heads,
# 576-token contexts): 128 takes 0.81 / 0.86 / 1.03 / 1.19 of 256's time at batch 1 / 16 / 64 / 256. One
# value for every batch size, so a row's result does not depend on the batch it is in.
SPLIT_KEYS = 128
DOT_MIN_GROUP = 2  # query heads per kv head from which scores use tl.dot (rows padded to 16)
MAX_CACHE_HEAD_ELEMENTS = 2**31  # page offsets within one kv head's slab are int32
LOG2_E = 1.4426950408889634
# fp32 operands of tl.dot: three tf32 tensor-core passes, about fp32 accuracy ("ieee" runs on CUDA
# cores and spills registers). bf16/fp16 operands ignore it.
DOT_PRECISION = tl.constexpr("tf32x3")


def key_tile(head_dim: int) -> int:
    """Keys per K/V tile of the decode kernel: 4096 elements, at most 64 keys.

    Block sizes here and in prefill.py were chosen from compiled sm_90 code, not GPU timings yet:
    the largest tiles whose bf16 kernels fit 255 registers without spilling (ptxas resource usage).
    """
    return min(64, 4096 // head_dim)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """How the decode kernel cuts and runs its work: keys per split, keys per K/V tile, warps,
    software-pipeline stages. A row's result depends on split_keys and block_n (the order of its
    sums), never on the batch: an engine keeps one config per cache dtype."""

    split_keys: int
    block_n: int
    num_warps: int
    num_stages: int


# FP8 rows: 512 keys a split, 64-key tiles of 128-wide heads, 2 warps, 2 stages. Each program streams
# half the bytes of a bf16 one, so with bf16's 128-key splits its fixed costs (the block table's loads
# ahead of the rows', the partial it writes and the merge) weighed twice as much: at 4k contexts and
# batch 64 on an H100 (bench.kv_decode_attention --sweep) this config reads at 0.81 of the copy
# bandwidth, bf16's config on FP8 rows at 0.50.
FP8_SPLIT_KEYS = 512
FP8_TILE_BYTES = 8192  # e4m3 bytes of one K or V tile: 64 keys of 128


def decode_config(head_dim: int, fp8: bool) -> DecodeConfig:
    """The engine's config for heads of `head_dim` over a bf16/fp16/fp32 cache or FP8 rows."""
    if fp8:
        return DecodeConfig(
            split_keys=FP8_SPLIT_KEYS, block_n=min(128, FP8_TILE_BYTES // head_dim), num_warps=2, num_stages=2
        )
    return DecodeConfig(split_keys=SPLIT_KEYS, block_n=key_tile(head_dim), num_warps=4, num_stages=3)


def fp8_cvt_instructions(device: torch.device) -> bool:
    """Whether kernels on `device` can convert e4m3 with PTX's cvt (compiled for CUDA, sm_89 or later)."""
    capability = compiled_capability(device)
    return capability is not None and capability >= (8, 9)


def check_supported(head_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError naming the setting when the Triton kernels cannot run this model."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"attention_backend='triton' supports head_dim in {SUPPORTED_HEAD_DIMS}, not head_dim={head_dim}"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention_backend='triton' supports dtypes {[str(d) for d in SUPPORTED_DTYPES]}, not {dtype} "
            f"(head_dim={head_dim})"
        )


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Checks common to both wrappers; q is [rows, heads, head_dim]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [kv_heads, pages, page_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    kv_heads, _, page_size, row_width = k_cache.shape
    head_dim = q.shape[2]
    fp8 = k_cache.dtype == torch.uint8
    if row_width != (row_bytes(head_dim) if fp8 else head_dim):
        kind = f"FP8 rows of {row_width} bytes" if fp8 else f"head_dim {row_width}"
        raise ValueError(f"q head_dim {head_dim} does not match the cache's {kind}")
    if kv_heads == 0 or q.shape[1] % kv_heads:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of the cache's {kv_heads} kv heads")
    if page_size < 8 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 8, got {page_size}")
    check_supported(head_dim, q.dtype)
    if v_cache.dtype != k_cache.dtype or (not fp8 and k_cache.dtype != q.dtype):
        raise ValueError(
            f"q ({q.dtype}), k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype "
            "(or both caches hold FP8 rows, uint8)"
        )
    for name, index in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if index.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {index.dtype}")
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"block_tables must be [B, max_pages] and seq_lens [B], "
            f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    if out is not None:
        tensors["out"] = out
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if q.stride(2) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {q.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache[0].numel() >= MAX_CACHE_HEAD_ELEMENTS:
        raise ValueError(f"one kv head's pages hold {k_cache[0].numel()} elements, over the kernels' int32 offsets")
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables' last dim must be contiguous, got strides {block_tables.stride()}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}) with its last dim contiguous, "
            f"got {tuple(out.shape)}, {out.dtype}, strides {out.stride()}"
        )


def cache_rows(cache: torch.Tensor, width: int) -> dict[str, int | bool]:
    """The constexprs `load_rows` takes for a cache of rows of `width` values."""
    return {"FP8": cache.dtype == torch.uint8, "ROW": cache.shape[-1], "SCALE_GROUP": scale_group(width)}


@triton.jit
def load_scaled_rows(head_ptr, row_starts, dims, mask, WIDTH: tl.constexpr):
    """The e4m3 values [N, len(dims)] and float32 scales [N] of FP8 rows with one scale each."""
    at = head_ptr + row_starts
    values = tl.load((at[:, None] + dims[None, :]).to(tl.pointer_type(tl.float8e4nv)), mask=mask[:, None], other=0.0)
    scales = tl.load((at + WIDTH).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    return values, scales


@triton.jit
def e4m3_to_fp16_as_loaded(values):
    """e4m3 values as fp16, converted in the layout they were loaded in (two per cvt instruction).

    Not marked pure, so Triton's layout optimizer cannot move the conversion after the change of layout
    that a dot operand needs: there, values contracted along keys (not along their contiguous head
    dimension) are read from shared memory a byte at a time; fp16 values move by ldmatrix instead."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[values.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def fp16_queries(q):
    """Queries [M, D] as fp16 operands for e4m3 keys, and each row's power-of-two scale: e4m3 converts to
    fp16 exactly in one instruction per two values (to bf16 it takes one more per value), and a row
    scaled to at most 1 cannot overflow fp16, whose longer mantissa holds its bf16 values exactly."""
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    exponent = tl.where(amax > 0, tl.ceil(tl.log2(amax)), 0.0)
    return (q.to(tl.float32) * tl.exp2(-exponent)[:, None]).to(tl.float16), tl.exp2(exponent)


@triton.jit
def fp16_probabilities(probs, v_scales):
    """Probabilities [M, N] times the values' scales [N] as fp16 operands for e4m3 values, relative to
    the tile's largest scale (returned, to multiply the product by): in [0, 1], where fp16 is finer
    than bf16."""
    top = tl.max(v_scales, axis=0)
    top = tl.where(top > 0, top, 1.0)
    return (probs * (v_scales / top)[None, :]).to(tl.float16), top


@triton.jit
def load_rows(head_ptr, row_starts, dims, mask, WIDTH: tl.constexpr, SCALE_GROUP: tl.constexpr, FP8: tl.constexpr):
    """[N, len(dims)] values of the cache rows starting at element offsets `row_starts` ([N]) of
    `head_ptr`: the cache's own dtype, or FP8 rows of WIDTH values dequantized to fp32."""
    if FP8:
        if SCALE_GROUP == WIDTH:
            # One scale per row, broadcast: one load per row, not one per value.
            values, row_scales = load_scaled_rows(head_ptr, row_starts, dims, mask, WIDTH)
            scales = row_scales[:, None]
        else:
            at = head_ptr + row_starts[:, None]
            values = tl.load((at + dims[None, :]).to(tl.pointer_type(tl.float8e4nv)), mask=mask[:, None], other=0.0)
            scale_ptrs = (at + WIDTH).to(tl.pointer_type(tl.float32))
            scales = tl.load(scale_ptrs + dims[None, :] // SCALE_GROUP, mask=mask[:, None], other=0.0)
        return values.to(tl.float32) * scales
    else:
        return tl.load(head_ptr + row_starts[:, None] + dims[None, :], mask=mask[:, None], other=0.0)


def sinks_log2(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The sinks checked against q ([rows, heads, head_dim]) and put in the kernels' base-2 units,
    float32: a new [heads] tensor (a few bytes per layer and step)."""
    check_sinks(sinks, heads=q.shape[1], device=q.device)
    return None if sinks is None else sinks.float() * LOG2_E


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of each sequence's last token over its cached keys: [B, heads, head_dim] in q.dtype.

    q: [B, heads, head_dim], the query at position seq_lens[b] - 1 (its K/V already in the cache);
    k_cache, v_cache: [kv_heads, pages, page_size, head_dim]; block_tables: [B, max_pages] int32;
    seq_lens: [B] int32, 0 for a padding row (its output is zeros); sinks: [heads] logits or None;
    config: how the kernel cuts the work (default: decode_config for the head and cache dtype).
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    sinks = sinks_log2(sinks, q)
    config = config or decode_config(q.shape[2], fp8=k_cache.dtype == torch.uint8)
    split_keys = config.split_keys
    if split_keys < 1 or split_keys % config.block_n:
        raise ValueError(f"split_keys must be a positive multiple of block_n {config.block_n}, got {split_keys}")
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows for {block_tables.shape[0]} sequences")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    batch, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_cache.shape
    max_pages = block_tables.shape[1]
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = heads // kv_heads
    num_splits = max(triton.cdiv(max_pages * page_size, split_keys), 1)
    part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    use_dot = group >= DOT_MIN_GROUP
    _decode_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        arrival_counters(q.device, batch * kv_heads),
        out,
        q if sinks is None else sinks,  # never read without sinks
        scale * LOG2_E,
        window or 0,
        max_pages,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        SPLIT_KEYS=split_keys,
        USE_WINDOW=window is not None,
        USE_DOT=use_dot,
        HAS_SINKS=sinks is not None,
        ASM_CONVERT=fp8_cvt_instructions(q.device),
        **launch_options(q.device),
        **cache_rows(k_cache, head_dim),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


MIN_COUNTERS = 4096  # the first buffer's (sequence, kv head) pairs: growth stays rare
# Per device, the arrival counters the decode kernel's last program resets: every buffer handed out
# stays referenced, since captured CUDA graphs hold their addresses.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters, all zero between launches. A larger buffer is allocated (and
    zeroed) only outside CUDA-graph capture: a graph's first, eager run sizes it."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"decode attention needs {count} arrival counters during CUDA-graph capture; "
                "run the step once outside the capture first"
            )
        grown = 2 * buffers[-1].numel() if buffers else MIN_COUNTERS
        buffers.append(torch.zeros(max(count, grown), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    out_ptr,
    sinks_ptr,  # [heads] fp32 sink logits * log2(e), read only with HAS_SINKS
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    window,
    max_pages,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kh,  # k and v caches are contiguous and share strides
    stride_kp,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
    ROW: tl.constexpr,  # elements of one cached row: HEAD_DIM, or an FP8 row's bytes
    SCALE_GROUP: tl.constexpr,
    ASM_CONVERT: tl.constexpr,  # e4m3 to fp16 by cvt instructions (e4m3_to_fp16_as_loaded)
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)  # kernels.pdl
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    num_keys = tl.minimum(seq_len, max_pages * PAGE_SIZE)  # never read past the block table
    query_pos = seq_len - 1
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(query_pos - window + 1, 0)
    # The splits that hold a visible key: the only ones written and merged.
    first_split = first_key // SPLIT_KEYS
    end_split = tl.cdiv(num_keys, SPLIT_KEYS)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    part = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * num_splits  # this row's first split
    if (split >= first_split) & (split < end_split):
        _attend_split(
            q_ptr + b.to(tl.int64) * stride_qb,
            k_ptr + kv_head.to(tl.int64) * stride_kh,
            v_ptr + kv_head.to(tl.int64) * stride_kh,
            block_tables_ptr + b.to(tl.int64) * stride_bt,
            part_out_ptr,
            part_lse_ptr,
            part + split,
            heads,
            row_ok,
            dims,
            tl.maximum(split * SPLIT_KEYS, first_key // BLOCK_N * BLOCK_N),  # tiles before the window are pruned
            tl.minimum((split + 1) * SPLIT_KEYS, num_keys),
            query_pos,
            window,
            scale_log2,
            stride_qh,
            stride_kp,
            BLOCK_H,
            HEAD_DIM,
            PAGE_SIZE,
            BLOCK_N,
            USE_WINDOW,
            USE_DOT,
            FP8,
            ROW,
            SCALE_GROUP,
            ASM_CONVERT,
        )

    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    counter = arrivals_ptr + b * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(counter, 0)  # all splits have arrived: zero again for the next launch
        _merge_splits(
            part_out_ptr,
            part_lse_ptr,
            part,
            first_split,
            end_split,
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            sinks_ptr + heads,
            row_ok,
            dims,
            BLOCK_H,
            HEAD_DIM,
            HAS_SINKS,
        )


@triton.jit
def _attend_split(
    q_ptr,
    k_head,
    v_head,
    table,
    part_out_ptr,
    part_lse_ptr,
    part,
    heads,
    row_ok,
    dims,
    start,
    end,
    query_pos,
    window,
    scale_log2,
    stride_qh,
    stride_kp,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    FP8: tl.constexpr,
    ROW: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    ASM_CONVERT: tl.constexpr,
):
    """Online softmax over keys [start, end) of the group's rows; stores the normalized partial
    output and its base-2 log-sum-exp at workspace row `part`."""
    ROW_SCALED: tl.constexpr = FP8 and SCALE_GROUP == HEAD_DIM
    q = tl.load(q_ptr + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    # fp32 queries keep fp32 operands (tf32x3 dots): fp16 would round them.
    F16_OPERANDS: tl.constexpr = ROW_SCALED and USE_DOT and q_ptr.dtype.element_ty != tl.float32
    score_scale = tl.full([BLOCK_H], scale_log2, tl.float32)
    if F16_OPERANDS:
        q, q_pow2 = fp16_queries(q)
        score_scale = score_scale * q_pow2
    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        visible = keys < end
        if USE_WINDOW:
            visible &= keys > query_pos - window
        pages = tl.load(table + keys // PAGE_SIZE, mask=visible, other=0)
        row_starts = pages * stride_kp + (keys % PAGE_SIZE) * ROW
        if ROW_SCALED:
            k, k_scale = load_scaled_rows(k_head, row_starts, dims, visible, HEAD_DIM)
            v, v_scale = load_scaled_rows(v_head, row_starts, dims, visible, HEAD_DIM)
            k = k.to(q.dtype)
            if F16_OPERANDS and ASM_CONVERT:
                v = e4m3_to_fp16_as_loaded(v)
            else:
                v = v.to(q.dtype)
        else:
            k = load_rows(k_head, row_starts, dims, visible, HEAD_DIM, SCALE_GROUP, FP8).to(q.dtype)
            v = load_rows(v_head, row_starts, dims, visible, HEAD_DIM, SCALE_GROUP, FP8).to(q.dtype)
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:
            scores = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        if ROW_SCALED:
            scores = scores * k_scale[None, :]
        scores = tl.where(visible[None, :], scores * score_scale[:, None], float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key yet stays at zero
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        if F16_OPERANDS:
            probs_v, v_top = fp16_probabilities(probs, v_scale)
            acc = acc * rescale[:, None] + tl.dot(probs_v, v, input_precision=DOT_PRECISION) * v_top
        else:
            probs_v = probs
            if ROW_SCALED:
                probs_v = probs * v_scale[None, :]
            if USE_DOT:
                acc = acc * rescale[:, None] + tl.dot(probs_v.to(v.dtype), v, input_precision=DOT_PRECISION)
            else:
                acc = acc * rescale[:, None] + tl.sum(probs_v[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        row_max = new_max

    has_keys = row_sum > 0  # a row that saw a key has row_sum >= 1
    row_sum = tl.where(has_keys, row_sum, 1.0)
    tl.store(part_lse_ptr + part, tl.where(has_keys, row_max + tl.log2(row_sum), float("-inf")), mask=row_ok)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / row_sum[:, None], mask=row_ok[:, None])


@triton.jit
def _merge_splits(
    part_out_ptr,
    part_lse_ptr,
    part,
    first_split,
    end_split,
    out_ptrs,
    sink_ptrs,
    row_ok,
    dims,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """The group's output from its splits [first_split, end_split), merged in split order, with the
    rows' sinks as one more split of zero output. Loads bypass L1 (.cg): the partials were written
    by other programs, possibly on other SMs."""
    if HAS_SINKS:
        sink = tl.load(sink_ptrs, mask=row_ok, other=float("-inf"))
    else:
        sink = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lse_max = sink
    for s in range(first_split, end_split):
        lse = tl.load(part_lse_ptr + part + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        lse_max = tl.maximum(lse_max, lse)
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a padding row: every weight is zero

    total = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    weight_sum = tl.exp2(sink - shift)  # 0 without a sink
    for s in range(first_split, end_split):
        lse = tl.load(part_lse_ptr + part + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(lse - shift)
        partial = tl.load(
            part_out_ptr + (part + s)[:, None] * HEAD_DIM + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        total += weight[:, None] * partial
        weight_sum += weight
    result = total / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None]
    tl.store(out_ptrs, result.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None])
