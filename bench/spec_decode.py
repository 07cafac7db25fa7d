"""Speculative decoding against no speculation, each variant's engine in the same run on the same
requests, at several concurrencies:

    python -m bench.spec_decode                                   # CPU, the real SmolLM2, n-gram drafts
    python -m bench.spec_decode --device cuda --concurrency 1,16,64,96 --variants none,fixed,dspark
    python -m bench.spec_decode --model /tmp/smollm2-dir   # the same model converted where it is not packaged

Variants: `none` (the peer), `fixed` (every request verifies up to K drafts each step, K =
--max-draft-tokens), `dspark` (the verification budget from the fitted step-time curve and the
drafts' calibrated confidence; needs --cost-model). The drafter is --spec-method's: n-gram prompt
lookup by default, whose acceptance comes from real text only with the real model: the prompts ask
for answers that quote their input (edit this code, summarise with quotes), the real SmolLM2 answers
them, greedy. With --random-weights (a model built from SmolLM2's config) the acceptance is
synthetic, and the JSON says so.

Per variant and concurrency C: C requests start together and run to their max tokens; output
tokens per second over the whole run, per-user tokens per second (each request's tokens over its own
time to its last token, the mean), engine steps, and from the engine's speculative-decoding counters
the draft tokens verified per request and step and the mean accepted length (1 + accepted draft
tokens per verifying request and step, vLLM's definition). `ratios` divide fixed by none, and dspark
by none and by fixed, at the same concurrency. Prints one JSON object.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest

VARIANTS = {
    "none": {},
    "fixed": {"spec_budget": "fixed"},
    "dspark": {"spec_budget": "dspark"},
}
# Each variant's peers, measured in the same run: fixed against no speculation, dspark against both.
PEERS = {"fixed": ("none",), "dspark": ("none", "fixed")}
SMOLLM2 = "smollm2-135m-instruct"
TEXT = Path(__file__).parent / "data" / "founding_documents.txt"
# Code to edit, each with the variable an edit renames.
CODE = [
    (
        "def area(width, height):\n    result = width * height\n    return result\n",
        "result",
    ),
    (
        "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n",
        "message",
    ),
    (
        (
            "def total(prices):\n    amount = 0\n    for price in prices:\n        amount = amount + price\n"
            "    return amount\n"
        ),
        "amount",
    ),
    (
        (
            "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self, step):\n"
            "        self.count = self.count + step\n        return self.count\n"
        ),
        "step",
    ),
]
EDITS = [
    "Rename the variable `{old}` to `value` and give back the whole code, unchanged otherwise.",
    "Add a docstring to the code below and repeat all of it with the docstring in place.",
]


def prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts, cycling through code edits and summaries that quote their passage."""
    passages = [p.strip() for p in TEXT.read_text().split("\n\n") if len(p.strip()) > 200][:8]
    tasks = []
    for index, (code, variable) in enumerate(CODE):
        tasks.append(f"{EDITS[index % len(EDITS)].format(old=variable)}\n\n```python\n{code}```")
    tasks += [f"Summarise this passage, quoting its key sentences word for word:\n\n{p[:700]}" for p in passages]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": tasks[i % len(tasks)]}]),
            allow_special=True,
        )
        for i in range(count)
    ]


def run_level(llm: LLM, requests: list[list[int]], max_tokens: int, tag: str) -> dict:
    engine = llm.engine
    before = _counters(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(requests):
        engine.add_request(EngineRequest(request_id=f"{tag}-{index}", prompt_token_ids=prompt, params=params))
    tokens: dict[str, int] = {}
    finished_at: dict[str, float] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] = tokens.get(delta.request_id, 0) + len(delta.token_ids)
            if delta.finished:
                finished_at[delta.request_id] = time.perf_counter()
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    after = _counters(engine)
    drafts = after["drafts"] - before["drafts"]
    return {
        "concurrency": len(requests),
        "output_tokens": sum(tokens.values()),
        "seconds": round(wall, 4),
        "output_tok_s": round(sum(tokens.values()) / wall, 2),
        "per_user_tok_s": round(sum(tokens[r] / (finished_at[r] - started) for r in tokens) / len(tokens), 3),
        "engine_steps": after["steps"] - before["steps"],
        "verified_per_draft": round((after["draft_tokens"] - before["draft_tokens"]) / drafts, 3) if drafts else 0.0,
        "mean_accepted_length": round(1 + (after["accepted"] - before["accepted"]) / drafts, 3) if drafts else 1.0,
    }


def _counters(engine) -> dict[str, int]:
    stats = engine.stats()
    spec = stats.spec_decode
    return {
        "steps": stats.steps.num_steps if stats.steps else 0,
        "drafts": spec.num_drafts if spec else 0,
        "draft_tokens": spec.num_draft_tokens if spec else 0,
        "accepted": spec.num_accepted_tokens if spec else 0,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    model = dict(SMOLLM2_135M_CONFIG) if args.random_weights else args.model
    # A model directory carries its own tokenizer; a config alone (random weights) borrows the packaged one.
    tokenizer = SMOLLM2 if args.random_weights or args.model == SMOLLM2 else None
    results: dict[str, list[dict]] = {}
    for variant in args.variants.split(","):
        settings = dict(VARIANTS[variant])
        if variant != "none":
            settings.update(
                spec_method=args.spec_method,
                spec_max_draft_tokens=args.max_draft_tokens,
            )
        if variant == "dspark":
            settings["cost_model"] = args.cost_model
        llm = LLM(
            model,
            device=args.device,
            seed=0,
            tokenizer=tokenizer,
            max_num_seqs=max(levels),
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
            enforce_eager=args.enforce_eager,
            gpu_memory_utilization=0.25,
            **settings,
        )
        requests = prompts(llm.tokenizer, max(levels))
        run_level(llm, requests[:1], 8, f"{variant}-warmup")
        results[variant] = [run_level(llm, requests[:level], args.max_tokens, f"{variant}-{level}") for level in levels]
        llm.close()
    ratios = {}
    for variant, rows in results.items():
        for peer in PEERS.get(variant, ()):
            if peer in results:
                ratios[f"{variant}_over_{peer}"] = {
                    str(row["concurrency"]): {
                        "output_tok_s": round(row["output_tok_s"] / base["output_tok_s"], 3),
                        "verified_per_draft": round(row["verified_per_draft"] / base["verified_per_draft"], 3)
                        if base["verified_per_draft"]
                        else None,
                        "mean_accepted_length": round(
                            row["mean_accepted_length"] / base["mean_accepted_length"],
                            3,
                        ),
                    }
                    for row, base in zip(rows, results[peer], strict=True)
                }
    print(
        json.dumps(
            {
                "benchmark": "spec_decode",
                "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                "model": "SmolLM2-135M config, random weights" if args.random_weights else args.model,
                "acceptance": "synthetic (random weights)" if args.random_weights else "real text, real model",
                "spec_method": args.spec_method,
                "max_draft_tokens": args.max_draft_tokens,
                "max_tokens": args.max_tokens,
                "variants": results,
                "ratios": ratios,
            },
            indent=2,
        )
    )
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=SMOLLM2,
        help="the packaged model's name, or a model directory or .gguf file of it (where the package is not installed)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--variants", default="none,fixed")
    parser.add_argument("--spec-method", default="ngram")
    parser.add_argument("--max-draft-tokens", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode or verify)")
    parser.add_argument(
        "--cost-model",
        help="a fitted cost model (bench.fit_cost_model --out): dspark needs one",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2's config with random weights",
    )
    args = parser.parse_args(argv)
    if args.random_weights and args.model != SMOLLM2:
        parser.error("--random-weights builds SmolLM2's config; it takes no --model")
    unknown = set(args.variants.split(",")) - VARIANTS.keys()
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    if "dspark" in args.variants.split(",") and not args.cost_model:
        parser.error("the dspark variant needs --cost-model (its budget comes from the fitted step-time curve)")
    return args


if __name__ == "__main__":
    sys.exit(main())
