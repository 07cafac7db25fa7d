"""Decode throughput of the engine on the model shapes of bench.shapes, as a fraction of each step's
memory roofline, with the device's copy bandwidth measured in the same run as the peer.

    python -m bench.decode_roofline --shapes llama3_8b,qwen3_30b_a3b_16_layers,deepseek_v2_lite \\
        --batch-sizes 1,16,64,256 --prompt-len 1024 --new-tokens 128

Random bf16 weights (drawn on the GPU). A decode step's roofline is the bytes it must read: every
weight it touches once (all but the routed experts and the embedding table, whose B rows are
negligible; of each sparse layer's routed experts, the expected number a batch of B tokens picks
under uniform routing, E * (1 - (1 - k/E)^B)) plus each sequence's KV over its mean context, at
the bytes per token of the model's KV cache spec. Its time at the copy bandwidth (a 1 GiB
device-to-device copy, bytes read plus written) over the measured step time is the fraction.
Timed: the run's decode-only engine calls (no prompt chunk in the step), after a warm-up run of two
prompts; a batch the KV cache takes in waves (`max_running`: the mean sequences per decode step) is
timed on its decode steps. Prints one JSON object.
"""

import argparse
import gc
import json
import sys
import time

import torch

from bench.shapes import shape
from workers.engine import LLM, SamplingParams
from workers.engine.layers.moe import RoutedExperts
from workers.protocol.engine_request import EngineRequest

COPY_BYTES = 1 << 30


def main() -> None:
    args = _parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_roofline measures a GPU: no CUDA device here")
    device = torch.device("cuda")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    copy_bytes_per_s = copy_bandwidth(device)
    print(json.dumps({"copy_bytes_per_s": copy_bytes_per_s}), file=sys.stderr, flush=True)
    results = []
    for name in args.shapes.split(","):
        results.append(_measure_shape(name, args, batch_sizes, copy_bytes_per_s))
        # The engine of one shape is gone before the next one's weights are drawn.
        gc.collect()
        torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "benchmark": "decode_roofline",
                "device": torch.cuda.get_device_name(device),
                "torch": torch.__version__,
                "dtype": "bfloat16",
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "copy_bytes_per_s": copy_bytes_per_s,
                "shapes": results,
            },
            indent=2,
        )
    )


def _measure_shape(name: str, args: argparse.Namespace, batch_sizes: list[int], copy_bytes_per_s: float) -> dict:
    context = args.prompt_len + args.new_tokens
    llm = LLM(
        shape(name),
        device="cuda",
        dtype=torch.bfloat16,
        enable_prefix_caching=False,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=args.max_batched_tokens,
        num_pages=max(batch_sizes) * -(-context // 16) + 2,
        max_model_len=context,
    )
    specs = llm.engine.runner.kv_cache.specs
    rows = decode_rows(llm, batch_sizes, args, copy_bytes_per_s, {"shape": name})
    result = {
        "shape": name,
        "kv_layout": specs.layout,
        "kv_bytes_per_token_per_layer": specs.groups[0].bytes_per_token_per_layer,
        "rows": rows,
    }
    llm.engine.close()
    return result


def decode_rows(
    llm: LLM, batch_sizes: list[int], args: argparse.Namespace, copy_bytes_per_s: float, label: dict[str, str]
) -> list[dict]:
    """Per batch size of random prompts (args.prompt_len, args.new_tokens): the engine's decode
    steps against their roofline, each row also printed to stderr after `label`."""
    runner = llm.engine.runner
    specs = runner.kv_cache.specs
    rows = []
    for batch_size in batch_sizes:
        prompts = torch.randint(
            0, runner.model.config.vocab_size, (batch_size, args.prompt_len), generator=torch.Generator().manual_seed(7)
        ).tolist()
        _run(llm, prompts[:2], 2)  # warm-up: kernels compile, the allocator grows
        measured = _run(llm, prompts, args.new_tokens)
        weight_bytes = touched_weight_bytes(runner.model, batch_size)
        # The sequences that ran at once: fewer than the batch where the KV cache cannot hold it all.
        running = measured["decode_tokens"] / measured["decode_steps"]
        kv_bytes = round(running * (args.prompt_len + args.new_tokens // 2) * specs.bytes_per_token)
        step_s = measured["decode_s"] / measured["decode_steps"]
        row = {
            "batch_size": batch_size,
            "max_running": round(running, 1),
            "first_token_s": round(measured["first_token_s"], 4),
            "total_s": round(measured["total_s"], 4),
            "decode_tok_s": round(measured["decode_tokens"] / measured["decode_s"], 1),
            "decode_steps": measured["decode_steps"],
            "step_ms": round(step_s * 1e3, 3),
            "weight_bytes_per_step": weight_bytes,
            "kv_bytes_per_step": kv_bytes,
            "roofline_step_ms": round((weight_bytes + kv_bytes) / copy_bytes_per_s * 1e3, 3),
            "roofline_fraction": round((weight_bytes + kv_bytes) / copy_bytes_per_s / step_s, 4),
        }
        rows.append(row)
        print(json.dumps({**label, **row}), file=sys.stderr, flush=True)
    return rows


def _run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """One run of `prompts` to `new_tokens` greedy tokens each, timing its decode-only engine calls:
    those whose every computed token was a sampled one (no prompt chunk rode along), so a batch the
    KV cache takes in waves is timed on its decode steps alone, not on the next wave's prefill."""
    engine = llm.engine
    stats = engine.step_stats
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    device = torch.device(engine.config.args.device)
    _synchronize(device)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"r{index}", prompt_token_ids=prompt, params=params))
    started: set[str] = set()
    first_token_s = None
    decode_s = 0.0
    decode_tokens = decode_steps = produced_total = 0
    while engine.has_unfinished():
        computed_before, steps_before = stats.tokens.total, stats.num_steps
        called = time.perf_counter()
        deltas = engine.step()
        seconds = time.perf_counter() - called
        produced = sum(len(delta.token_ids) for delta in deltas)
        produced_total += produced
        started.update(delta.request_id for delta in deltas)
        if produced and stats.tokens.total - computed_before == produced:
            decode_s += seconds
            decode_tokens += produced
            decode_steps += stats.num_steps - steps_before
        if first_token_s is None and len(started) == len(prompts):
            first_token_s = time.perf_counter() - start
    _synchronize(device)
    assert produced_total == len(prompts) * new_tokens
    return {
        "first_token_s": first_token_s,
        "total_s": time.perf_counter() - start,
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "decode_steps": decode_steps,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def touched_weight_bytes(model: torch.nn.Module, batch_size: int) -> int:
    """Bytes of the weights one decode step of `batch_size` tokens reads (see the module docstring)."""
    total = 0
    experts = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
    embedding = {id(model.embed_tokens.weight)} if model.lm_head is not None else set()
    for param in model.parameters():
        if id(param) not in experts and id(param) not in embedding:
            total += param.numel() * param.element_size()
    moe = model.config.moe
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            num_experts = module.w13.shape[0]
            per_expert = sum(p[0].numel() * p.element_size() for p in (module.w13, module.w2))
            picked = num_experts * (1 - (1 - moe.top_k / num_experts) ** batch_size)
            total += round(picked * per_expert)
    return total


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a large device-to-device copy (median of 20)."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * COPY_BYTES / sorted(times[5:])[len(times[5:]) // 2]


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama3_8b,qwen3_30b_a3b_16_layers,deepseek_v2_lite")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=32768)
    return parser.parse_args()


if __name__ == "__main__":
    main()
