"""What FP8 costs in accuracy: a model's perplexity on a fixed public-domain text through the real engine,
per precision variant, and each variant's greedy agreement with the unquantized engine.

    python -m bench.perplexity [--model smollm2-135m-instruct] [--variants baseline,fp8_weights,fp8_kv,fp8_both]
                               [--dtype bfloat16] [--device cpu] [--window 1024] [--chunk 128] [--max-tokens N]
                               [--new-tokens 64]

Variants are engine settings (workers.args): `baseline` is the unquantized engine in --dtype (bfloat16,
as served on GPUs, by default on the CPU too, which runs it; the CPU engine's own default is float32);
`fp8_weights` adds quantization="fp8", `fp8_kv` kv_cache_dtype="fp8", `fp8_both` both. Each row names
the dtypes its weights and KV cache are held in, as the engine reports them.

Perplexity: the text (bench/data/founding_documents.txt, ~2,850 SmolLM2 tokens; its README says where
it comes from) is cut into windows of --window tokens, each one request whose prompt logprobs the engine
reports (prompt_logprobs=0: each prompt token's logprob given the tokens before it). The engine takes at
most --chunk tokens a step, so each window is prefilled in chunks and every chunk after the first reads
the keys and values of the chunks before it from the paged KV cache: an FP8 cache is written and read
back as it is when serving. Perplexity is exp of the mean negative logprob over every token but each
window's first.

Greedy agreement, on the held prompts of the SmolLM2 exactness tests (bench.held_prompts), --new-tokens
greedy tokens each, in two ways:
- `greedy_prefix_agreement`: each variant generates freely; per prompt, the length of the prefix its
  tokens share with the baseline's, over --new-tokens (after the first difference the two continue
  from different text, so later positions say nothing), averaged over the prompts. One near-tie early
  on ends a prompt's count, so on a small model this swings with a few flips.
- `greedy_token_agreement`: each prompt followed by the baseline's greedy tokens is given to the
  variant as a prompt, teacher-forced (prompt logprobs again); the fraction of those tokens the
  variant ranks first given the same tokens before them. Per position and free of the cascade, this
  is the steady measure: 1 - it is the rate at which the variant's greedy choice differs.

Prints one JSON object; `ratio` is a variant's perplexity over the baseline's, `seconds` a variant's
whole run (loading the model included). `ratio_95` is the ratio's 95% interval over the text, from a
paired block bootstrap: the scored tokens in blocks of BOOTSTRAP_BLOCK consecutive ones, resampled
with replacement BOOTSTRAP_SAMPLES times (a fixed seed), each sample's ratio the exp of the variant's
mean loss minus the baseline's over the same tokens. On a few thousand tokens a handful of them
carry much of a quantized model's loss increase, so the interval is wide (about +-0.02 at a 1.04 ratio
on SmolLM2): two settings whose ratios differ by less say little about which is better.
"""

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.held_prompts import held_prompts
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest
from workers.protocol.logprobs import TokenLogprobs

TEXT = Path(__file__).resolve().parent / "data" / "founding_documents.txt"
BASELINE = "baseline"
VARIANTS: dict[str, dict[str, Any]] = {
    BASELINE: {},
    "fp8_weights": {"quantization": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8_both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
BOOTSTRAP_BLOCK = 64  # tokens: neighbours' losses are correlated
BOOTSTRAP_SAMPLES = 2000
# Scoring a window only needs its prompt; one new token is the least a request may ask for.
SCORE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)  # not slotted: the command line takes its defaults from the class
class Setup:
    """What every variant of one comparison shares."""

    model: str = "smollm2-135m-instruct"
    dtype: str | None = "bfloat16"
    device: str = "cpu"
    window: int = 1024  # tokens of text per scored request
    chunk: int = 128  # the engine's tokens per step: the prefill chunk
    max_tokens: int | None = None  # score only the text's first this many tokens
    new_tokens: int = 64  # greedy tokens per held prompt

    def __post_init__(self) -> None:
        if self.window < 2 or self.chunk < 1 or self.new_tokens < 1:
            raise ValueError(
                f"window must be >= 2, chunk and new_tokens >= 1; got {self.window}, {self.chunk}, {self.new_tokens}"
            )


@dataclass(frozen=True, slots=True)
class Measured:
    """One variant's row of the JSON, and its free-running greedy tokens per held prompt."""

    row: dict[str, Any]
    greedy: list[list[int]]
    token_losses: list[float]  # each scored token's negative logprob, in text order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=Setup.model)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--dtype", default=Setup.dtype, help="the engine's dtype (default: %(default)s)")
    parser.add_argument("--device", default=Setup.device)
    parser.add_argument("--window", type=int, default=Setup.window, help="tokens of text per scored request")
    parser.add_argument("--chunk", type=int, default=Setup.chunk, help="the engine's tokens per step (prefill chunk)")
    parser.add_argument("--max-tokens", type=int, help="score only the text's first this many tokens")
    parser.add_argument("--new-tokens", type=int, default=Setup.new_tokens, help="greedy tokens per held prompt")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := [name for name in variants if name not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    setup = Setup(**{name: value for name, value in vars(args).items() if name != "variants"})
    print(json.dumps(run(variants, setup), indent=2))


def run(variants: list[str], setup: Setup) -> dict[str, Any]:
    """Each variant's row, against the baseline's (measured first, whether asked for or not: the ratios
    and agreements need it)."""
    baseline = measure(BASELINE, setup)
    rows = {name: baseline.row if name == BASELINE else measure(name, setup, baseline).row for name in variants}
    return {
        "benchmark": "perplexity",
        **asdict(setup),
        "text": TEXT.name,
        "held_prompts": len(baseline.greedy),
        "variants": rows,
    }


def measure(name: str, setup: Setup, baseline: Measured | None = None) -> Measured:
    """A variant's perplexity, and its greedy agreement with `baseline` (None: this is the baseline)."""
    started = time.perf_counter()
    llm = LLM(setup.model, dtype=setup.dtype, device=setup.device, max_num_batched_tokens=setup.chunk, **VARIANTS[name])
    try:
        text = llm.tokenizer.encode(TEXT.read_text())[: setup.max_tokens]
        losses = token_losses(llm, text, setup.window)
        prompts = held_prompts(llm.tokenizer)
        params = SamplingParams(temperature=0.0, max_tokens=setup.new_tokens, ignore_eos=True)
        greedy = [result.token_ids for result in llm.generate(prompts, params)]
        reference = baseline.greedy if baseline is not None else greedy
        forced = prompt_logprobs(llm, [p + tokens for p, tokens in zip(prompts, reference, strict=True)])
        info = llm.engine.info
    finally:
        llm.close()
    prefixes = [_common_prefix(ours, theirs) for ours, theirs in zip(greedy, reference, strict=True)]
    firsts = [entry.rank == 1 for prompt, entries in zip(prompts, forced) for entry in entries[len(prompt) :]]
    perplexity = math.exp(sum(losses) / len(losses))
    row = {
        "settings": VARIANTS[name],
        "weights": info.weight_dtype,
        "kv_cache": info.kv_cache_dtype,
        "perplexity": perplexity,
        "ratio": perplexity / baseline.row["perplexity"] if baseline is not None else 1.0,
        "ratio_95": ratio_interval(losses, baseline.token_losses) if baseline is not None else [1.0, 1.0],
        "text_tokens": len(text),
        "tokens_scored": len(losses),
        "greedy_prefix_agreement": sum(prefixes) / (len(prefixes) * setup.new_tokens),
        "greedy_prefix_lengths": prefixes,
        "greedy_token_agreement": sum(firsts) / len(firsts),
        "seconds": time.perf_counter() - started,
    }
    return Measured(row=row, greedy=greedy, token_losses=losses)


def token_losses(llm: LLM, tokens: list[int], window: int) -> list[float]:
    """The negative logprob of each of `tokens` scored in windows of `window` (each window's first
    token is not scored: nothing comes before it)."""
    windows = [tokens[start : start + window] for start in range(0, len(tokens), window)]
    scored = [entry for entries in prompt_logprobs(llm, [w for w in windows if len(w) > 1]) for entry in entries[1:]]
    return [-entry.logprob for entry in scored]


def ratio_interval(losses: list[float], baseline_losses: list[float]) -> list[float]:
    """The perplexity ratio's 95% interval by a paired block bootstrap over the scored tokens."""
    if len(losses) != len(baseline_losses):
        raise ValueError(f"{len(losses)} scored tokens against the baseline's {len(baseline_losses)}")
    differences = [ours - theirs for ours, theirs in zip(losses, baseline_losses, strict=True)]
    blocks = [differences[start : start + BOOTSTRAP_BLOCK] for start in range(0, len(differences), BOOTSTRAP_BLOCK)]
    sums = [(sum(block), len(block)) for block in blocks]
    draw = random.Random(0)
    ratios = []
    for _ in range(BOOTSTRAP_SAMPLES):
        picked = draw.choices(sums, k=len(sums))
        ratios.append(math.exp(sum(total for total, _ in picked) / sum(count for _, count in picked)))
    ratios.sort()
    return [round(ratios[int(0.025 * BOOTSTRAP_SAMPLES)], 4), round(ratios[int(0.975 * BOOTSTRAP_SAMPLES) - 1], 4)]


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[TokenLogprobs | None]]:
    """Per prompt, the engine's logprob and rank of each of its tokens given those before it (None for
    the first), all prompts in one batch, each prefilled in the engine's chunks."""
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(request_id=str(index), prompt_token_ids=prompt, params=SCORE, prompt_logprobs=0)
        )
    entries: dict[str, list[TokenLogprobs | None]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.prompt_logprobs is not None:
                entries[delta.request_id] = delta.prompt_logprobs
    if sorted(entries) != sorted(map(str, range(len(prompts)))):
        raise RuntimeError("the engine did not report every prompt's logprobs")
    return [entries[str(index)] for index in range(len(prompts))]


def _common_prefix(ours: list[int], theirs: list[int]) -> int:
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return position
    return min(len(ours), len(theirs))


if __name__ == "__main__":
    main()
