"""TTFT of a sliding-window model's prompt whose prefix is in the global KV store, by where the SWA state
at the prefix end comes from, against computing the prompt from scratch, in one run.

    python -m bench.swa_replay [--model gemma3-270m | --shape gpt_oss_20b] [--lengths 2048,8192,32768]
                               [--device cpu] [--block-tokens 128] [--repeats 1]

Per prompt length, a writer engine computes every block of the prompt but the last, which stores the
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
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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
    text = _text(model)
    rows = [_length_row(model, length, args, text) for length in lengths]
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


def _length_row(model: Any, length: int, args: argparse.Namespace, text: list[int] | int) -> dict:
    prompt = _prompt(text, length, 0)
    stored = (length - 1) // args.block_tokens * args.block_tokens
    options = {
        "device": args.device,
        "enable_prefix_caching": False,
        "kv_block_tokens": args.block_tokens,
        "max_num_batched_tokens": 4096,
        "max_model_len": length + 16,
    }
    row: dict[str, Any] = {"prompt_tokens": length, "stored_tokens": stored, "ttft_s": {}, "replayed_tokens": {}}
    with tempfile.TemporaryDirectory(prefix="sluice-swa-bench-") as store:
        writer = LLM(model, kv_store=store, **options)
        writer.generate([prompt[:stored]], FIRST_TOKEN)
        engines = {
            "state_held": writer,
            "approximate_replay": LLM(model, kv_store=store, swa_replay="approximate", swa_state_bytes=0, **options),
            "exact_replay": LLM(model, kv_store=store, swa_replay="exact", swa_state_bytes=0, **options),
            "no_cache": LLM(model, **options),
        }
        for name in CONDITIONS:
            engine = engines[name]
            before = _replayed(engine)
            row["ttft_s"][name] = round(statistics.median(_ttft(engine, prompt) for _ in range(args.repeats)), 4)
            row["replayed_tokens"][name] = (_replayed(engine) - before) // args.repeats
        if args.kl:
            divergences = []
            for i in range(args.kl):
                other = _prompt(text, length, 997 * (i + 1))
                writer.generate([other[:stored]], FIRST_TOKEN)  # its prefix stored, as the timed prompt's
                divergences.append(_kl(engines["approximate_replay"], engines["exact_replay"], other))
            row["kl_approximate_from_exact"] = {
                "mean": round(statistics.fmean(divergences), 6),
                "max": round(max(divergences), 6),
                "prompts": args.kl,
            }
        for engine in engines.values():
            engine.close()
    exact = row["replayed_tokens"]["exact_replay"]
    row["recompute_avoided"] = round(1 - row["replayed_tokens"]["approximate_replay"] / exact, 4) if exact else None
    ttft = row["ttft_s"]
    row["approximate_over_state_held"] = round(ttft["approximate_replay"] / ttft["state_held"], 3)
    return row


def _ttft(engine: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.generate([prompt], FIRST_TOKEN)
    return time.perf_counter() - started


def _replayed(engine: LLM) -> int:
    swa = engine.engine.stats().swa
    return swa.replayed_tokens if swa is not None else 0


def _kl(approximate: LLM, exact: LLM, prompt: list[int]) -> float:
    """KL(exact || approximate) of the next-token distribution after `prompt`, over the tokens both
    sides' top logprobs name and one outcome for the rest of each side's mass (see the docstring)."""
    (reference,) = exact.generate([prompt], NEXT_TOKEN_LOGPROBS)
    (ours,) = approximate.generate([prompt], NEXT_TOKEN_LOGPROBS)
    p = dict(reference.outputs[0].logprobs[0].top)
    q = dict(ours.outputs[0].logprobs[0].top)
    shared = set(p) & set(q)
    p_named = [math.exp(p[token]) for token in shared]
    q_named = [math.exp(q[token]) for token in shared]
    p_rest, q_rest = max(1 - sum(p_named), 1e-12), max(1 - sum(q_named), 1e-12)
    named = sum(pt * math.log(pt / qt) for pt, qt in zip(p_named, q_named))
    return named + p_rest * math.log(p_rest / q_rest)


if __name__ == "__main__":
    main()
