"""Prefill and decode throughput of our engine against HF transformers `generate`, same weights, same run.

    python -m bench.engine_throughput                       # CPU, the real SmolLM2, small sizes
    python -m bench.engine_throughput --device cuda --random-weights \\
        --batch-sizes 1,16,64,256 --prompt-len 512 --new-tokens 128

Every prompt is distinct random tokens (no prefix-cache hits) of the same length (no padding for HF).
One timed run per engine and batch size, after a warm-up: prefill tokens/s is B * prompt_len over
the time until every request has its first token; decode tokens/s is B * (new_tokens - 1) over the
time from there to the last token (device synchronised at each timestamp). Prints one JSON object;
`ratios` divides ours by each peer.
"""

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest


def main() -> None:
    args = _parse_args()
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype or _default_dtype(device)]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _model_directory(args, Path(scratch))
        hf_model = _load_hf(model_dir, device, dtype)
        vocab_size = hf_model.config.vocab_size
        llm = LLM(
            model_dir,
            device=args.device,
            dtype=dtype,
            enable_prefix_caching=False,
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=args.max_batched_tokens,
            # Room for the largest batch at full length: the benchmark measures batching, not preemption.
            num_pages=max(batch_sizes) * -(-(args.prompt_len + args.new_tokens) // 16) + 2,
            max_model_len=args.prompt_len + args.new_tokens,
        )
        rows = []
        for batch_size in batch_sizes:
            prompts = torch.randint(
                0, vocab_size, (batch_size, args.prompt_len), generator=torch.Generator().manual_seed(batch_size)
            )
            runners: dict[str, Callable[[int], tuple[float, float]]] = {"sluice": timed_engine_run(llm, prompts)}
            for peer in args.peers.split(","):
                if peer:
                    runners[peer] = _hf(hf_model, prompts.to(device), static=peer == "hf_static")
            for name, run in runners.items():
                measured = measure_run(
                    run, args.new_tokens, batch_size, args.prompt_len, full_warm_up=name == "hf_static"
                )
                measured["decode_hbm_fraction"] = _decode_bandwidth_fraction(
                    llm, measured["decode_tok_s"], batch_size, args.prompt_len + args.new_tokens // 2
                )
                rows.append({"batch_size": batch_size, "engine": name, **measured})
                print(json.dumps(rows[-1]), flush=True, file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "engine_throughput",
                "device": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or "cpu",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "dtype": str(dtype).removeprefix("torch."),
                "weights": "random (SmolLM2-135M config)" if args.random_weights else args.model,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "rows": rows,
                "ratios": _ratios(rows),
            },
            indent=2,
        )
    )


def measure_run(
    run: Callable[[int], tuple[float, float]], new_tokens: int, batch_size: int, prompt_len: int, *, full_warm_up: bool
) -> dict:
    # Warm-up: allocator, kernels, lazy initialisation, compilation. HF's static cache compiles for
    # its cache length: it warms up at the timed length, or it would compile again inside the timed run.
    run(new_tokens if full_warm_up else 2)
    first_token_s, total_s = run(new_tokens)
    return {
        "prefill_tok_s": round(batch_size * prompt_len / first_token_s, 1),
        "decode_tok_s": round(batch_size * (new_tokens - 1) / (total_s - first_token_s), 1),
        "first_token_s": round(first_token_s, 4),
        "total_s": round(total_s, 4),
    }


class _Clock:
    """Wall-clock time since `start`, taken after the device has finished its queued work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = self.now_raw()

    def now_raw(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def elapsed(self) -> float:
        return self.now_raw() - self.start


def timed_engine_run(llm: LLM, prompts: torch.Tensor) -> Callable[[int], tuple[float, float]]:
    """(time until every request has its first token, time until all are done)."""
    token_lists = prompts.tolist()
    engine = llm.engine
    device = torch.device(llm.engine.config.args.device)

    def run(new_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        clock = _Clock(device)
        for index, prompt in enumerate(token_lists):
            engine.add_request(EngineRequest(request_id=str(index), prompt_token_ids=prompt, params=params))
        started: set[str] = set()
        first_token = None
        produced = 0
        while engine.has_unfinished():
            for delta in engine.step():
                started.add(delta.request_id)
                produced += len(delta.token_ids)
            if first_token is None and len(started) == len(token_lists):
                first_token = clock.elapsed()
        assert produced == len(token_lists) * new_tokens
        return first_token, clock.elapsed()

    return run


def _hf(model: torch.nn.Module, prompts: torch.Tensor, *, static: bool) -> Callable[[int], tuple[float, float]]:
    from transformers.generation.streamers import BaseStreamer

    mask = torch.ones_like(prompts)
    extra = {"cache_implementation": "static"} if static else {}

    class TokenTimes(BaseStreamer):
        """generate() calls put() with the prompt, then once per step with the new tokens."""

        def __init__(self, clock: _Clock) -> None:
            self.clock = clock
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(self.clock.elapsed())

        def end(self) -> None:
            pass

    def run(new_tokens: int) -> tuple[float, float]:
        times = TokenTimes(_Clock(prompts.device))
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=times,
                **extra,
            )
        assert out.shape[1] == prompts.shape[1] + new_tokens
        return times.times[1], times.times[-1]

    return run


def _model_directory(args: argparse.Namespace, scratch: Path) -> Path:
    """An HF-format directory both engines load, so they run the very same weights."""
    if not args.random_weights:
        from workers.engine.weights import resolve_model

        return resolve_model(args.model).directory
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_CONFIG)).save_pretrained(scratch)
    return scratch


def _load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


# What one H200 moves in practice (a large device-to-device copy, bytes read plus written).
PEAK_BYTES_PER_S = 4.3e12


def _decode_bandwidth_fraction(llm: LLM, tok_s: float, batch_size: int, mean_context: int) -> float:
    """Achieved fraction of PEAK_BYTES_PER_S at this decode rate: each step reads every weight once
    and each sequence's KV (mean_context tokens) once; one step yields batch_size tokens."""
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    per_token = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_cache.layers) // (
        runner.kv_cache.num_pages * runner.kv_cache.page_size
    )
    kv_bytes = batch_size * mean_context * per_token
    return round(tok_s / batch_size * (weight_bytes + kv_bytes) / PEAK_BYTES_PER_S, 4)


def _ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """ours / peer for each metric, per peer and batch size."""
    ratios: dict[str, dict[str, float]] = {}
    ours = {r["batch_size"]: r for r in rows if r["engine"] == "sluice"}
    for row in rows:
        if row["engine"] == "sluice":
            continue
        mine = ours[row["batch_size"]]
        for metric in ("prefill_tok_s", "decode_tok_s"):
            ratios.setdefault(f"{metric} vs {row['engine']}", {})[str(row["batch_size"])] = round(
                mine[metric] / row[metric], 3
            )
    return ratios


def _default_dtype(device: torch.device) -> str:
    return "bfloat16" if device.type == "cuda" else "float32"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--random-weights", action="store_true", help="SmolLM2-135M config, random weights (no download)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--peers", default="hf_eager,hf_static", help="comma list of hf_eager, hf_static")
    parser.add_argument("--max-batched-tokens", type=int, default=4096)
    return parser.parse_args()


if __name__ == "__main__":
    main()
