"""Which form of MLA prefill (extend) is faster at which lengths: the absorbed form the engine runs
(workers.engine.models.mla) against the decompressed form, at DeepSeek-V2-Lite's 16 heads and
DeepSeek-V3's 128 (bench.shapes: latent 512 + 64, per-head nope 128, values 128), bf16, pages of 16:

    python -m bench.mla_prefill_forms [--chunks 64,256,1024,4096] [--prefixes 0,2048,8192] [--batch-sizes 1,4]
    python -m bench.mla_prefill_forms --device cpu    # toy sizes in float32, Triton's interpreter

A step extends each of `batch` sequences by a chunk of N new tokens after a cached prefix of P; the
latents of all P + N tokens are already in the paged cache. Both forms start from the new tokens'
query parts (q_nope, and q_rope with rotary applied), kv_b_proj's weight and the latent cache, and
end at the [batch * N, heads, v_head_dim] output that o_proj reads:

- absorbed: each head's q_nope times W_UK, multi-query attention of all heads over the
  (kv_lora_rank + rope)-wide latents with their first kv_lora_rank columns as values
  (kernels' paged_mla_prefill), the output times W_UV. Per visible (query, key, head):
  kv_lora_rank + rope + kv_lora_rank multiply-adds (576 + 512).
- decompressed: gather the P + N latents, expand them with kv_b_proj into every head's k_nope and v
  (one GEMM over P + N tokens), append the shared rotary key to each head's key, then causal
  multi-head attention (torch's SDPA) of the N queries over the P + N keys. Per visible (query,
  key, head): nope + rope + v multiply-adds (192 + 128), plus the expansion.

Each call is timed eagerly with CUDA events, median of --repeats calls after --warmup: the
decompressed form's shapes are host ints a CUDA graph would freeze, so neither form is graphed and
both pay their launch overhead (visible at small chunks). A row gives both forms' µs per call, the
FLOPs each must do (2 x multiply-adds, masked-out pairs not counted) and their TFLOP/s, the ratio
decompressed / absorbed (over 1: absorbed wins), the two outputs' largest difference, and the
attention ops SDPA dispatched to (from torch's profiler). Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.shapes import shape
from workers.engine.config import MlaConfig
from workers.engine.models.registry import model_config

SHAPES = ("deepseek_v2_lite", "deepseek_v3")
PAGE = 16  # workers/args.py's default page_size
# The CPU's toy shape: Triton's interpreter runs the kernel in seconds.
TINY_HEADS = 2
TINY_MLA = MlaConfig(
    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, softmax_scale=32**-0.5
)


@dataclass(frozen=True)
class ExtendStep:
    """`batch` sequences, each extended by `chunk` new tokens after `prefix` cached ones, the latents
    of all prefix + chunk tokens already in the cache. Rows of the queries are sequence-major."""

    q_nope: torch.Tensor  # [batch * chunk, heads, qk_nope_head_dim]
    q_rope: torch.Tensor  # [batch * chunk, heads, qk_rope_head_dim], rotary applied
    kv_b_weight: torch.Tensor  # kv_b_proj's [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    latent_cache: torch.Tensor  # [1, pages, page_size, kv_lora_rank + qk_rope_head_dim]
    block_tables: torch.Tensor  # [batch, pages per sequence] int32
    query_start: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32, all prefix + chunk
    prefix: int
    chunk: int


def make_step(
    heads: int,
    mla: MlaConfig,
    *,
    batch: int,
    prefix: int,
    chunk: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> ExtendStep:
    """Random queries, weights and latents; each sequence's pages are scattered over the pool (page 0
    left unused, the engine's null page), as a long-running engine's are."""
    generator = torch.Generator(device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    seq_len = prefix + chunk
    pages_per_seq = -(-seq_len // page)
    pages = torch.randperm(batch * pages_per_seq, generator=torch.Generator().manual_seed(seed)) + 1
    tokens = batch * chunk
    kv_b_rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return ExtendStep(
        q_nope=randn(tokens, heads, mla.qk_nope_head_dim),
        q_rope=randn(tokens, heads, mla.qk_rope_head_dim),
        # kv_b_proj's input is kv_a_layernorm's output (RMS about 1): this scale keeps k_nope and v about 1 too.
        kv_b_weight=randn(kv_b_rows, mla.kv_lora_rank, scale=mla.kv_lora_rank**-0.5),
        latent_cache=randn(1, batch * pages_per_seq + 1, page, mla.latent_width),
        block_tables=pages.to(device, torch.int32).view(batch, pages_per_seq),
        query_start=torch.arange(0, tokens + 1, chunk, device=device, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, device=device, dtype=torch.int32),
        prefix=prefix,
        chunk=chunk,
    )


def absorbed_attention(step: ExtendStep, mla: MlaConfig) -> torch.Tensor:
    """MLAAttention's absorbed form: [batch * chunk, heads, v_head_dim]."""
    # Imported here (as is torch's causal bias, which imports Triton): Triton reads TRITON_INTERPRET
    # when first imported, and main sets it first on the CPU.
    from kernels.attention.triton import paged_mla_prefill

    heads = step.q_nope.shape[1]
    weight = step.kv_b_weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    w_uk, w_uv = weight[:, : mla.qk_nope_head_dim], weight[:, mla.qk_nope_head_dim :].transpose(1, 2)
    q_latent = torch.bmm(step.q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    out = paged_mla_prefill(
        torch.cat([q_latent, step.q_rope], dim=-1),
        step.latent_cache,
        step.block_tables,
        step.query_start,
        step.seq_lens,
        max_query_len=step.chunk,
        v_dim=mla.kv_lora_rank,
        scale=mla.softmax_scale,
    )
    return torch.bmm(out.transpose(0, 1), w_uv).transpose(0, 1)


def decompressed_attention(step: ExtendStep, mla: MlaConfig) -> torch.Tensor:
    """HF DeepSeek's form over the paged latents: [batch * chunk, heads, v_head_dim]. Every sequence
    has the same prefix and chunk, so the batch is one gather, one GEMM and one SDPA call."""
    from torch.nn.attention.bias import causal_lower_right

    batch, heads = step.block_tables.shape[0], step.q_nope.shape[1]
    keys = step.prefix + step.chunk
    pages = -(-keys // step.latent_cache.shape[2])
    latents = step.latent_cache[0, step.block_tables[:, :pages]].flatten(1, 2)[:, :keys]  # [batch, keys, latent]
    compressed, k_rope = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    expanded = (compressed @ step.kv_b_weight.T).view(batch, keys, heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, value = expanded.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    key = torch.cat([k_nope, k_rope[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)
    query = torch.cat([step.q_nope, step.q_rope], dim=-1).view(batch, step.chunk, heads, mla.qk_head_dim)
    # Lower-right causal: the chunk's i-th query sits at position prefix + i and sees keys 0..prefix + i
    # (SDPA's is_causal aligns top-left, which is the same only without a prefix).
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=causal_lower_right(step.chunk, keys),
        scale=mla.softmax_scale,
    )
    return out.transpose(1, 2).reshape(batch * step.chunk, heads, mla.v_head_dim)


FORMS: dict[str, Callable[[ExtendStep, MlaConfig], torch.Tensor]] = {
    "absorbed": absorbed_attention,
    "decompressed": decompressed_attention,
}


def form_flops(form: str, heads: int, mla: MlaConfig, *, batch: int, prefix: int, chunk: int) -> int:
    """2 x the multiply-adds a form must do; a query sees the prefix and the chunk up to itself."""
    visible = chunk * prefix + chunk * (chunk + 1) // 2
    rank, nope, rope, v = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    if form == "absorbed":
        per_seq = chunk * heads * (nope * rank + rank * v) + visible * heads * (rank + rope + rank)
    else:
        per_seq = (prefix + chunk) * rank * heads * (nope + v) + visible * heads * (nope + rope + v)
    return 2 * batch * per_seq


def median_us(run: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        else:
            start_s = time.perf_counter()
            run()
            times.append((time.perf_counter() - start_s) * 1e6)
    return statistics.median(times)


def sdpa_ops(run: Callable[[], object]) -> list[str]:
    """The attention ops one call dispatches to: which SDPA backend took the 192/128 head dims."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = {event.key for event in prof.key_averages()}
    return sorted(op for op in ops if "attention" in op and op != "aten::scaled_dot_product_attention")


def measure(name: str, heads: int, mla: MlaConfig, *, batch: int, prefix: int, chunk: int, dtype, device, args) -> dict:
    row = {"shape": name, "heads": heads, "batch": batch, "chunk": chunk, "prefix": prefix}
    try:
        step = make_step(heads, mla, batch=batch, prefix=prefix, chunk=chunk, page=PAGE, dtype=dtype, device=device)
        outputs = {form: attend(step, mla) for form, attend in FORMS.items()}
    except torch.cuda.OutOfMemoryError:
        # One configuration too large (SDPA falling back to its math backend, say) keeps the other rows.
        torch.cuda.empty_cache()
        return {**row, "error": "out of memory"}
    for form, attend in FORMS.items():
        us = median_us(lambda attend=attend: attend(step, mla), device, warmup=args.warmup, repeats=args.repeats)
        flops = form_flops(form, heads, mla, batch=batch, prefix=prefix, chunk=chunk)
        row[f"{form}_us"] = round(us, 1)
        row[f"{form}_flops"] = flops
        row[f"{form}_tflops"] = round(flops / us / 1e6, 2)
    row["decompressed_over_absorbed"] = round(row["decompressed_us"] / row["absorbed_us"], 3)
    row["winner"] = "absorbed" if row["decompressed_over_absorbed"] > 1 else "decompressed"
    difference = (outputs["absorbed"].float() - outputs["decompressed"].float()).abs().max().item()
    row["max_abs_difference"] = float(f"{difference:.3g}")
    row["sdpa_ops"] = sdpa_ops(lambda: decompressed_attention(step, mla))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--chunks", default=None, help="new tokens per sequence (default 64,256,1024,4096; cpu 4,16)")
    parser.add_argument("--prefixes", default=None, help="cached tokens per sequence (default 0,2048,8192; cpu 0,20)")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench.mla_prefill_forms times CUDA kernels: it needs a CUDA device (--device cpu for a toy run)")
        dtype, chunks, prefixes = torch.bfloat16, args.chunks or "64,256,1024,4096", args.prefixes or "0,2048,8192"
        configs = {name: model_config(shape(name)) for name in SHAPES}
        shapes = {name: (config.num_heads, config.mla) for name, config in configs.items()}
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is first imported
        # The interpreter gaps the test suite patches (loop bounds under numpy 2.4) are ours too.
        from tests.triton_interpreter import patch_interpreter

        patch_interpreter()
        dtype, chunks, prefixes = torch.float32, args.chunks or "4,16", args.prefixes or "0,20"
        shapes = {"tiny": (TINY_HEADS, TINY_MLA)}
    rows = [
        measure(name, heads, mla, batch=batch, prefix=prefix, chunk=chunk, dtype=dtype, device=device, args=args)
        for name, (heads, mla) in shapes.items()
        for batch in (int(b) for b in args.batch_sizes.split(","))
        for chunk in (int(n) for n in chunks.split(","))
        for prefix in (int(p) for p in prefixes.split(","))
    ]
    print(json.dumps({"benchmark": "mla_prefill_forms", "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "dtype": str(dtype).removeprefix("torch."), "page_size": PAGE,
                      "torch": torch.__version__, "warmup": args.warmup, "repeats": args.repeats,
                      "shapes": {name: {"heads": heads, "kv_lora_rank": mla.kv_lora_rank,
                                        "qk_nope_head_dim": mla.qk_nope_head_dim,
                                        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
                                        "softmax_scale": mla.softmax_scale} for name, (heads, mla) in shapes.items()},
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
