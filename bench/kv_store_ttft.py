"""TTFT of a long prompt whose prefix is in the global KV store, against the same prompt computed from
scratch, in one run on the same engine build.

    python -m bench.kv_store_ttft [--prompt-len 2000] [--stored-len 1900] [--repeats 3]

A first engine computes the first `stored-len` tokens, which writes their whole blocks to a fresh
store. Then two engines, one on that store and one without any, each time the whole prompt to its
first token, `repeats` times (median). Both run without the engine-local prefix cache, so every
repeat either fetches the prefix from the store (files → host memory → pages) or recomputes it.
Prints one JSON object.
"""

import argparse
import json
import random
import statistics
import tempfile
import time

from workers.engine import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--stored-len", type=int, default=1900)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-tokens", type=int, default=128)
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]

    with tempfile.TemporaryDirectory(prefix="sluice-kv-bench-") as store_dir:
        options = {"max_num_batched_tokens": 4096, "enable_prefix_caching": False, "kv_block_tokens": args.block_tokens}
        writer = LLM(MODEL, kv_store=store_dir, **options)
        writer.generate([prompt[: args.stored_len]], FIRST_TOKEN)
        writer.close()

        with_store = LLM(MODEL, kv_store=store_dir, **options)
        without_store = LLM(MODEL, **options)
        cached = with_store.generate([prompt], FIRST_TOKEN)[0].num_cached_tokens  # warm-up
        without_store.generate([prompt], FIRST_TOKEN)
        hit = [_seconds(with_store, prompt) for _ in range(args.repeats)]
        miss = [_seconds(without_store, prompt) for _ in range(args.repeats)]
        with_store.close()

    print(
        json.dumps(
            {
                "benchmark": "kv_store_ttft",
                "model": MODEL,
                "device": "cpu",
                "prompt_tokens": args.prompt_len,
                "stored_prompt_tokens": args.stored_len,
                "cached_tokens": cached,
                "ttft_s": {
                    "store_hit": round(statistics.median(hit), 4),
                    "no_store": round(statistics.median(miss), 4),
                },
                "ttft_ratio_hit_over_none": round(statistics.median(hit) / statistics.median(miss), 4),
            },
            indent=2,
        )
    )


def _seconds(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([prompt], FIRST_TOKEN)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
