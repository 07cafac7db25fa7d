"""TTFT of a sliding-window model's prompt whose prefix is in the global KV store, by where the SWA state
at the prefix end comes from, against computing the prompt from scratch, in one run.

    python -m bench.swa_replay [--model gemma3-270m | --shape gpt_oss_20b] [--lengths 2048,8192,32768]
                               [--device cpu] [--block-tokens 128] [--repeats 1]

A writer engine computes every block of each prompt but the last, which stores the
full-attention layers' blocks and keeps the sliding-window layers' state in its host cache. Then the
whole prompt's time to first token, each on an engine without its local prefix cache:
- `state_held`: the writer itself, whose host cache holds the SWA state at the hit (what a fetch from
  the holding worker brings, without the wire);
- `approximate_replay`: an engine on the same store without the state: the hit backs off one block
  and the window before it is replayed, attention cut at the replay's start (DeepSeek's mode);
- `exact_replay`: the same, replaying early enough to rebuild the window exactly;
- `no_cache`: an engine without a store.
Each engine's SWA counters say what it replayed. `recompute_avoided` is 1 - the approximate replay's
recomputed tokens over the exact one's (DeepSeek reports > 85%). With `--kl N`, the KL divergence of
the approximate replay's next-token distribution from the exact one's, at the end of N prompts of the
length (the tokens both sides' top logprobs name, the rest of the mass as one outcome: a lower bound of
the whole distributions' KL, by the data-processing inequality).

Prompts are real text where the model has a tokenizer (this repository's README and docs, which are
English prose; windows of it at different offsets), random token ids otherwise.

`--model` is a packaged model name or an HF directory (real weights); `--shape` a bench.shapes entry
with random weights (the GPU's gpt-oss-20b shape). Prints one JSON object.
"""

import argparse
import gc
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.shapes import shape
from workers.engine import LLM, SamplingParams
from workers.protocol.sampling_params import MAX_LOGPROBS

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
NEXT_TOKEN_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=MAX_LOGPROBS)
ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = ("state_held", "approximate_replay", "exact_replay", "no_cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="gemma3-270m")
    source.add_argument("--shape", help="a bench.shapes entry, with random weights")
    parser.add_argument("--lengths", default="2048,8192,32768", help="prompt lengths, comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kl", type=int, default=0, help="prompts per length for the approximate replay's KL")
    args = parser.parse_args()
    model: Any = shape(args.shape) if args.shape else args.model
    lengths = [int(length) for length in args.lengths.split(",")]
    rows = _rows(model, lengths, args, _text(model))
    print(
        json.dumps(
            {
                "benchmark": "swa_replay",
                "model": args.shape or args.model,
                "device": args.device,
                "block_tokens": args.block_tokens,
                "rows": rows,
            },
            indent=2,
        )
    )


def _text(model: Any) -> list[int] | int:
    """This repository's prose in the model's tokens; for a model without a tokenizer, its vocabulary
    size (prompts are then random ids)."""
    if isinstance(model, dict):
        return int(model["vocab_size"])
    engine = LLM(model, num_pages=4)
    tokenizer, vocab_size = engine.tokenizer, engine.engine.info.model_config.vocab_size
    engine.close()
    if tokenizer is None:
        return vocab_size
    prose = "\n\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return tokenizer.encode(prose)


def _prompt(text: list[int] | int, length: int, offset: int) -> list[int]:
    """`length` tokens of the text from `offset` on (wrapping around), or random ids below `text`, a
    vocabulary size."""
    if isinstance(text, int):
        return [random.Random(length + offset).randrange(text) for _ in range(length)]
    return [text[(offset + i) % len(text)] for i in range(length)]


def _rows(model: Any, lengths: list[int], args: argparse.Namespace, text: list[int] | int) -> list[dict]:
    """One row per prompt length. One engine at a time, each serving every length: a GPU holds one
    gpt-oss-20b's weights, not four. Each engine first serves a short prompt twice (a miss, then a hit),
    so no timed prompt pays for compiling kernels."""
    prompts = {length: _prompt(text, length, 0) for length in lengths}
    kl_prompts = {length: [_prompt(text, length, 997 * (i + 1)) for i in range(args.kl)] for length in lengths}
    stored = {length: (length - 1) // args.block_tokens * args.block_tokens for length in lengths}
    warmup = _prompt(text, 2 * args.block_tokens + 5, 7919)
    options = {
        "device": args.device,
        "enable_prefix_caching": False,
        "kv_block_tokens": args.block_tokens,
        "max_num_batched_tokens": 4096,
        "max_model_len": max(lengths) + 16,
    }
    rows = {
        length: {"prompt_tokens": length, "stored_tokens": stored[length], "ttft_s": {}, "replayed_tokens": {}}
        for length in lengths
    }
    next_tokens: dict[str, dict[int, list[Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-swa-bench-") as store:
        conditions = {
            "state_held": {"kv_store": store},
            "approximate_replay": {"kv_store": store, "swa_replay": "approximate", "swa_state_bytes": 0},
            "exact_replay": {"kv_store": store, "swa_replay": "exact", "swa_state_bytes": 0},
            "no_cache": {},
        }
        for name in CONDITIONS:
            engine = LLM(model, **conditions[name], **options)
            if name == "state_held":  # the writer: it stores every prompt but its last block
                for length in lengths:
                    engine.generate(
                        [prompt[: stored[length]] for prompt in [prompts[length], *kl_prompts[length]]], FIRST_TOKEN
                    )
            engine.generate([warmup], FIRST_TOKEN)
            engine.generate([warmup], FIRST_TOKEN)
            for length in lengths:
                before = _replayed(engine)
                seconds = [_ttft(engine, prompts[length]) for _ in range(args.repeats)]
                rows[length]["ttft_s"][name] = round(statistics.median(seconds), 4)
                rows[length]["replayed_tokens"][name] = (_replayed(engine) - before) // args.repeats
            if name in ("approximate_replay", "exact_replay") and args.kl:
                next_tokens[name] = {length: _next_token_logprobs(engine, kl_prompts[length]) for length in lengths}
            engine.close()
            del engine
            _release_device_memory(args.device)
    for length, row in rows.items():
        if args.kl:
            pairs = zip(next_tokens["exact_replay"][length], next_tokens["approximate_replay"][length], strict=True)
            divergences = [_kl(reference, ours) for reference, ours in pairs]
            row["kl_approximate_from_exact"] = {
                "mean": round(statistics.fmean(divergences), 6),
                "max": round(max(divergences), 6),
                "prompts": args.kl,
            }
        exact = row["replayed_tokens"]["exact_replay"]
        approximate = row["replayed_tokens"]["approximate_replay"]
        row["recompute_avoided"] = round(1 - approximate / exact, 4) if exact else None
        ttft = row["ttft_s"]
        row["approximate_over_state_held"] = round(ttft["approximate_replay"] / ttft["state_held"], 3)
    return list(rows.values())


def _release_device_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _ttft(engine: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.generate([prompt], FIRST_TOKEN)
    return time.perf_counter() - started


def _replayed(engine: LLM) -> int:
    swa = engine.engine.stats().swa
    return swa.replayed_tokens if swa is not None else 0


def _next_token_logprobs(engine: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    """Each prompt's next-token top logprobs."""
    outputs = engine.generate(prompts, NEXT_TOKEN_LOGPROBS)
    return [dict(output.outputs[0].logprobs[0].top) for output in outputs]


def _kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) of two next-token distributions given by their top logprobs, over the tokens both
    name and one outcome for the rest of each side's mass (see the docstring)."""
    shared = set(p) & set(q)
    p_named = [math.exp(p[token]) for token in shared]
    q_named = [math.exp(q[token]) for token in shared]
    p_rest, q_rest = max(1 - sum(p_named), 1e-12), max(1 - sum(q_named), 1e-12)
    named = sum(pt * math.log(pt / qt) for pt, qt in zip(p_named, q_named))
    return named + p_rest * math.log(p_rest / q_rest)


if __name__ == "__main__":
    main()
