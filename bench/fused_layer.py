"""The fused decode-layer kernels against the sequence they replace, at SmolLM2-135M's shapes in bf16, on CUDA.

    python -m bench.fused_layer [--rows 1,16,64,128,256] [--context 512] [--sweep]

Needs only torch, triton and numpy (the kernels' own modules; no engine, no Django, no msgspec).

For each row count M (decode rows, one token per sequence of `--context` cached tokens):
- qkv: fused_add_rms_norm + F.linear (cuBLAS) + rotary_and_cache_write, against
  add_rms_norm_qkv_rotary;
- gate_up: fused_add_rms_norm + F.linear + silu_and_mul, against add_rms_norm_gate_up_silu;
- lm_head: fused_add_rms_norm + F.linear + .float(), against add_rms_norm_linear(out_dtype=float32);
- attention: paged_decode_attention (one launch) alone;
- layer: a whole decode layer, the ten-kernel sequence (nine launches now that attention is one)
  against the five-kernel one, each layer's output feeding the next;
- gemm_alone: F.linear alone on the qkv, gate_up and lm_head shapes, a floor for the fused kernels.
Each variant is timed as CUDA-graph replays of 30 repetitions (median of triton.testing.do_bench,
which clears L2 before each replay), repetition i using layer i's weights and KV cache, as the
model's 30 layers do, so weights come from DRAM as in a real step (lm_head rotates over 4 copies).
`step_old_us` and `step_new_us` estimate a decode step as 30 layers + lm_head (embedding and sampling
not included), `tokens_per_s_old` and `tokens_per_s_new` the decode rate that gives at M rows.

Before timing, every fused kernel and the decode attention are checked against torch references on
fresh inputs at each M; `max_error` holds the largest absolute difference and its ratio to the reference's largest
magnitude. Prints one JSON object; `ratios` divides the old sequence's time by the fused one's.

--sweep also times candidate block shapes for each fused kernel and M (kernels.fused.linear.BLOCKS
entries) and adds `sweep`: per kernel and M, the fastest shapes and the table's current ones.
"""

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from kernels.attention.triton.decode import paged_decode_attention
from kernels.fused import (
    add_rms_norm_gate_up_silu,
    add_rms_norm_gate_up_silu_reference,
    add_rms_norm_linear,
    add_rms_norm_linear_reference,
    add_rms_norm_qkv_rotary,
    add_rms_norm_qkv_rotary_reference,
    fused_add_rms_norm,
    rotary_and_cache_write,
    silu_and_mul,
)
from kernels.fused.linear import BLOCKS, Blocks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 576, 9, 3, 64, 1536, 49152, 30
PAGE_SIZE, EPS, DTYPE = 16, 1e-5, torch.bfloat16
LM_HEAD_COPIES = 4
CUDA = torch.device("cuda")


@dataclass
class Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass
class Step:
    """One decode step's inputs at M rows: each row a sequence of `context` cached tokens."""

    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,64,128,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    cos, sin = rotary_tables(max(args.context + 64, 4096))
    lm_heads = [weight(VOCAB, HIDDEN) for _ in range(LM_HEAD_COPIES)]
    result = {"device": torch.cuda.get_device_name(), "dtype": str(DTYPE), "reps": LAYERS, "context": args.context}
    result["max_error"] = {m: check_kernels(m, args.context, cos, sin) for m in rows}
    times, ratios, sweeps = {}, {}, {}
    for m in rows:
        step = make_step(m, args.context, cos, sin)
        layers = [make_layer(m, args.context) for _ in range(LAYERS)]
        times[m] = time_row_count(m, step, layers, lm_heads)
        ratios[m] = {
            name: round(entry["old_us"] / entry["new_us"], 3)
            for name, entry in times[m].items()
            if isinstance(entry, dict) and "old_us" in entry
        }
        if args.sweep:
            sweeps[m] = sweep(m, step, layers, lm_heads)
        del layers
        torch.cuda.empty_cache()
    result["times_us"] = times
    result["ratios"] = ratios
    if args.sweep:
        result["sweep"] = sweeps
    print(json.dumps(result, indent=1))


# Inputs.


def weight(rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols, device=CUDA) * cols**-0.5).to(DTYPE)


def norm_weight() -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(HIDDEN, device=CUDA)).to(DTYPE)


def activations(m: int) -> torch.Tensor:
    return torch.randn(m, HIDDEN, device=CUDA).to(DTYPE)


def rotary_tables(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's tables for rope_theta 100000 (SmolLM2), float32 [positions, head_dim]."""
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, HEAD_DIM, 2, device=CUDA).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(positions, device=CUDA).float(), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().contiguous(), angles.sin().contiguous()


def pages_per_sequence(context: int) -> int:
    return -(-(context + 64) // PAGE_SIZE)  # a table as wide as max_model_len = context + 64


def make_layer(m: int, context: int) -> Layer:
    pages = m * pages_per_sequence(context) + 1
    k_cache = torch.randn(KV_HEADS, pages, PAGE_SIZE, HEAD_DIM, device=CUDA).to(DTYPE)
    return Layer(
        norm_weight(),
        weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
        weight(HIDDEN, HEADS * HEAD_DIM),
        norm_weight(),
        weight(2 * INTERMEDIATE, HIDDEN),
        weight(HIDDEN, INTERMEDIATE),
        k_cache,
        torch.randn_like(k_cache),
    )


def make_step(m: int, context: int, cos: torch.Tensor, sin: torch.Tensor) -> Step:
    width = pages_per_sequence(context)
    block_tables = (1 + torch.randperm(m * width, device=CUDA)).view(m, width).to(torch.int32)
    position = context  # the new token's position: the cache holds `context` keys before it
    slots = block_tables[:, position // PAGE_SIZE].long() * PAGE_SIZE + position % PAGE_SIZE
    return Step(
        positions=torch.full((m,), position, dtype=torch.int64, device=CUDA),
        slots=slots,
        block_tables=block_tables,
        seq_lens=torch.full((m,), context + 1, dtype=torch.int32, device=CUDA),
        cos=cos,
        sin=sin,
    )


# Correctness on the GPU.


def check_kernels(m: int, context: int, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, dict[str, float]]:
    x, residual, ln = activations(m), activations(m), norm_weight()
    layer, step = make_layer(m, context), make_step(m, context, cos, sin)
    slots = torch.randperm(layer.k_cache.shape[1] * PAGE_SIZE, device=CUDA)[:m]
    positions = torch.randint(0, cos.shape[0], (m,), device=CUDA)
    expected_k, expected_v = layer.k_cache.clone(), layer.v_cache.clone()
    heads = {"num_heads": HEADS, "num_kv_heads": KV_HEADS}
    expected_q, _ = add_rms_norm_qkv_rotary_reference(
        x, residual, ln, EPS, layer.qkv, None, positions, cos, sin, expected_k, expected_v, slots, **heads
    )
    q, _ = add_rms_norm_qkv_rotary(
        x, residual, ln, EPS, layer.qkv, None, positions, cos, sin, layer.k_cache, layer.v_cache, slots, **heads
    )
    lm_head = weight(VOCAB, HIDDEN)
    attention_args = (q, layer.k_cache, layer.v_cache, step.block_tables, step.seq_lens)
    pairs = {
        "qkv_rotary_q": (q, expected_q),
        "qkv_rotary_k_cache": (layer.k_cache, expected_k),
        "qkv_rotary_v_cache": (layer.v_cache, expected_v),
        "gate_up_silu": (
            add_rms_norm_gate_up_silu(x, residual, ln, EPS, layer.gate_up)[0],
            add_rms_norm_gate_up_silu_reference(x, residual, ln, EPS, layer.gate_up)[0],
        ),
        "lm_head_fp32": (
            add_rms_norm_linear(x, residual, ln, EPS, lm_head, out_dtype=torch.float32)[0],
            add_rms_norm_linear_reference(x, residual, ln, EPS, lm_head, out_dtype=torch.float32)[0],
        ),
        "decode_attention": (
            paged_decode_attention(*attention_args, scale=0.125),
            attention_reference(*attention_args, scale=0.125),
        ),
    }
    errors = {}
    for name, (actual, expected) in pairs.items():
        error = (actual.float() - expected.float()).abs().max().item()
        scale = expected.float().abs().max().item()
        errors[name] = {"max_abs": error, "max_abs_over_max_ref": error / scale}
    return errors


def attention_reference(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float) -> torch.Tensor:
    """float32 softmax attention of each row's query over its sequence's keys, page by page."""
    rows = []
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        pages = block_tables[b, : -(-length // PAGE_SIZE)].long()
        k, v = (cache[:, pages].flatten(1, 2)[:, :length].float() for cache in (k_cache, v_cache))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (k, v))
        probs = (torch.einsum("hd,hkd->hk", q[b].float(), k) * scale).softmax(dim=-1)
        rows.append(torch.einsum("hk,hkd->hd", probs, v))
    return torch.stack(rows).to(q.dtype)


# Timing.


def graph_time_us(repetition: Callable[[int], object], reps: int = LAYERS, rep_ms: int = 150) -> float:
    """Median microseconds per repetition over CUDA-graph replays of `reps` repetitions."""
    repetition(0)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(reps):
            repetition(index)
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=rep_ms, return_mode="median")
    del graph
    return round(1000 * ms / reps, 3)


def time_row_count(m: int, step: Step, layers: list[Layer], lm_heads: list[torch.Tensor]) -> dict:
    x, residual = activations(m), activations(m)
    heads = {"num_heads": HEADS, "num_kv_heads": KV_HEADS}
    lm_rows = [lm_heads[i % LM_HEAD_COPIES] for i in range(LAYERS)]

    def qkv_old(i):
        layer = layers[i]
        normed = fused_add_rms_norm(x, residual, layer.ln1, EPS)
        qkv = F.linear(normed, layer.qkv).view(m, HEADS + 2 * KV_HEADS, HEAD_DIM)
        qk, v = qkv[:, : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
        return rotary_and_cache_write(
            qk, v, step.positions, step.cos, step.sin, layer.k_cache, layer.v_cache, step.slots, num_heads=HEADS
        )

    def qkv_new(i):
        layer = layers[i]
        return add_rms_norm_qkv_rotary(
            x, residual, layer.ln1, EPS, layer.qkv, None, step.positions, step.cos, step.sin,
            layer.k_cache, layer.v_cache, step.slots, **heads,
        )  # fmt: skip

    def gate_up_old(i):
        return silu_and_mul(F.linear(fused_add_rms_norm(x, residual, layers[i].ln2, EPS), layers[i].gate_up))

    def gate_up_new(i):
        return add_rms_norm_gate_up_silu(x, residual, layers[i].ln2, EPS, layers[i].gate_up)

    def lm_head_old(i):
        return F.linear(fused_add_rms_norm(x, residual, layers[0].ln1, EPS), lm_rows[i]).float()

    def lm_head_new(i):
        return add_rms_norm_linear(x, residual, layers[0].ln1, EPS, lm_rows[i], out_dtype=torch.float32)

    q = torch.randn(m, HEADS, HEAD_DIM, device=CUDA).to(DTYPE)

    def attention(i):
        layer = layers[i]
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, step.block_tables, step.seq_lens, scale=0.125)

    chain = {"hidden": x.clone(), "residual": residual.clone()}

    def layer_old(i):
        layer = layers[i]
        hidden, res = chain["hidden"], chain["residual"]
        normed = fused_add_rms_norm(hidden, res, layer.ln1, EPS)
        qkv = F.linear(normed, layer.qkv).view(m, HEADS + 2 * KV_HEADS, HEAD_DIM)
        q = rotary_and_cache_write(
            qkv[:, : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :], step.positions, step.cos, step.sin,
            layer.k_cache, layer.v_cache, step.slots, num_heads=HEADS,
        )  # fmt: skip
        attended = paged_decode_attention(
            q, layer.k_cache, layer.v_cache, step.block_tables, step.seq_lens, scale=0.125
        )
        out = F.linear(attended.view(m, HEADS * HEAD_DIM), layer.o)
        normed = fused_add_rms_norm(out, res, layer.ln2, EPS)
        chain["hidden"] = F.linear(silu_and_mul(F.linear(normed, layer.gate_up)), layer.down)

    def layer_new(i):
        layer = layers[i]
        q, res = add_rms_norm_qkv_rotary(
            chain["hidden"], chain["residual"], layer.ln1, EPS, layer.qkv, None, step.positions, step.cos, step.sin,
            layer.k_cache, layer.v_cache, step.slots, **heads,
        )  # fmt: skip
        attended = paged_decode_attention(
            q, layer.k_cache, layer.v_cache, step.block_tables, step.seq_lens, scale=0.125
        )
        out = F.linear(attended.view(m, HEADS * HEAD_DIM), layer.o)
        activated, res = add_rms_norm_gate_up_silu(out, res, layer.ln2, EPS, layer.gate_up)
        chain["hidden"], chain["residual"] = F.linear(activated, layer.down), res

    normed = activations(m)
    entries = {
        "qkv": (qkv_old, qkv_new),
        "gate_up": (gate_up_old, gate_up_new),
        "lm_head": (lm_head_old, lm_head_new),
        "layer": (layer_old, layer_new),
    }
    times = {name: {"old_us": graph_time_us(old), "new_us": graph_time_us(new)} for name, (old, new) in entries.items()}
    times["attention_us"] = graph_time_us(attention)
    times["gemm_alone_us"] = {
        "qkv": graph_time_us(lambda i: F.linear(normed, layers[i].qkv)),
        "gate_up": graph_time_us(lambda i: F.linear(normed, layers[i].gate_up)),
        "lm_head": graph_time_us(lambda i: F.linear(normed, lm_rows[i])),
    }
    for path in ("old", "new"):
        step_us = LAYERS * times["layer"][f"{path}_us"] + times["lm_head"][f"{path}_us"]
        times[f"step_{path}_us"] = round(step_us, 1)
        times[f"tokens_per_s_{path}"] = round(m * 1e6 / step_us)
    return times


# Block-shape sweep.

WARPS_STAGES = ((2, 4), (4, 3), (4, 4), (8, 3))
COLUMN_BLOCKS = {"linear": (64, 128, 256), "gate_up": (8, 16, 32, 64), "qkv": (8, 16, 32, 64)}


def row_blocks(m: int) -> tuple[int, ...]:
    return (16,) if m <= 16 else (16, 32, 64) if m <= 64 else (32, 64, 128)


def sweep(m: int, step: Step, layers: list[Layer], lm_heads: list[torch.Tensor]) -> dict:
    x, residual = activations(m), activations(m)
    heads = {"num_heads": HEADS, "num_kv_heads": KV_HEADS}
    runs = {
        "qkv": lambda i: add_rms_norm_qkv_rotary(
            x,
            residual,
            layers[i].ln1,
            EPS,
            layers[i].qkv,
            None,
            step.positions,
            step.cos,
            step.sin,
            layers[i].k_cache,
            layers[i].v_cache,
            step.slots,
            **heads,
        ),  # fmt: skip
        "gate_up": lambda i: add_rms_norm_gate_up_silu(x, residual, layers[i].ln2, EPS, layers[i].gate_up),
        "linear": lambda i: add_rms_norm_linear(
            x, residual, layers[0].ln1, EPS, lm_heads[i % LM_HEAD_COPIES], out_dtype=torch.float32
        ),
    }
    found = {}
    for kernel, run in runs.items():
        table = BLOCKS[kernel]
        current = graph_time_us(run)
        timed = []
        for block_m, block_n, (warps, stages) in itertools.product(row_blocks(m), COLUMN_BLOCKS[kernel], WARPS_STAGES):
            BLOCKS[kernel] = ((1 << 30, Blocks(block_m, block_n, 64, warps, stages)),)
            try:
                timed.append((graph_time_us(run, rep_ms=40), f"Blocks({block_m}, {block_n}, 64, {warps}, {stages})"))
            except (OutOfResources, triton.CompilationError) as error:  # e.g. too much shared memory
                timed.append(
                    (float("inf"), f"Blocks({block_m}, {block_n}, 64, {warps}, {stages}): {type(error).__name__}")
                )
            finally:
                BLOCKS[kernel] = table
        timed.sort(key=lambda entry: entry[0])
        found[kernel] = {"current_us": current, "best": [f"{t} us {blocks}" for t, blocks in timed[:3]]}
        print(f"sweep M={m} {kernel}: {json.dumps(found[kernel])}", file=sys.stderr, flush=True)  # survives a timeout
    return found


if __name__ == "__main__":
    main()
