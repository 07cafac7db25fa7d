"""Write a reproducible, reuse-skewed trace in the Mooncake format, for `bench.trace_replay`.

    python -m bench.skewed_trace --out FILE [--requests 4000] [--prefixes 300] [--zipf 1.1] [--seed 0]
        [--rate 4.0] [--min-prefix-blocks 2] [--max-prefix-blocks 48] [--tail-tokens 2048]
        [--tail-sigma 1.2] [--max-tail-tokens 32768] [--output-tokens 128]

The model. Requests arrive as a Poisson process (`--rate` per second; exponential gaps). Each prompt is
a shared prefix followed by a unique tail:
- The prefix is one of `--prefixes` fixed prefixes (system prompts, few-shot templates, documents that
  many users ask about), picked independently per request with Zipf popularity: the prefix of rank k
  (1-based) has probability proportional to 1 / k^zipf. Each prefix is a whole number of 512-token
  blocks, between `--min-prefix-blocks` and `--max-prefix-blocks`, log-uniform (many short system
  prompts, fewer long documents), drawn independently of rank.
- The tail is one-off content (the user's message, a pasted file): a log-normal number of tokens with
  median `--tail-tokens` and log-space spread `--tail-sigma`, at least 1 and at most
  `--max-tail-tokens`. Its blocks get ids never used before or after, and its last block is usually
  partial.
- The output length is log-normal with median `--output-tokens` (sigma 1), between 1 and 4096.

Trace lines are `{"timestamp": ms, "input_length", "output_length", "hash_ids"}` as in Mooncake:
`hash_ids` are the prompt's 512-token blocks, `input_length` = prefix blocks x 512 + tail tokens, so
there are ceil(input_length / 512) ids. A prefix's ids are the same in every request that uses it (a
block id names its whole prefix, as Mooncake's chained ids do, and a prefix always starts the
prompt). Ids are numbered in order of first appearance, as in the Mooncake traces. The same arguments
and seed give the same file.

Why this is the traffic a segmented LRU is for. Reuse here is skewed: a few prefixes take most of
the traffic and are re-read within seconds, a long tail of prefixes is re-read every few minutes,
and every request writes a burst of blocks (its tail) that will never be read again. Under LRU each
burst pushes out the least recent blocks, so a store that could hold every popular prefix many times
over still spends most of its space on dead tails, and a moderately popular prefix is flushed
between two of its uses. The segmented LRU (`workers/kvstore/eviction.py`) keeps never-hit blocks in
probation, where the tails churn among themselves, and protects blocks that have been hit at least
once, so prefixes with proven reuse survive the bursts. The Mooncake synthetic trace lacks this
skew (its reuse times are close to memoryless), which is why the policy barely beats LRU there.
"""

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
MAX_OUTPUT_TOKENS = 4096
OUTPUT_SIGMA = 1.0


@dataclass(frozen=True)
class SkewedTraceConfig:
    requests: int = 4000
    prefixes: int = 300
    zipf: float = 1.1
    seed: int = 0
    rate: float = 4.0  # requests per second
    min_prefix_blocks: int = 2
    max_prefix_blocks: int = 48
    tail_tokens: int = 2048  # median
    tail_sigma: float = 1.2
    max_tail_tokens: int = 32768
    output_tokens: int = 128  # median

    def validate(self) -> None:
        """Raise ValueError, naming the command-line option, for the first invalid setting."""
        if self.requests <= 0:
            raise ValueError(f"--requests must be positive, got {self.requests}")
        if self.prefixes <= 0:
            raise ValueError(f"--prefixes must be positive, got {self.prefixes}")
        if not (math.isfinite(self.zipf) and self.zipf >= 0):
            raise ValueError(f"--zipf must be a finite number >= 0 (0 = uniform popularity), got {self.zipf}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"--rate must be a positive number of requests per second, got {self.rate}")
        if self.min_prefix_blocks <= 0:
            raise ValueError(f"--min-prefix-blocks must be positive, got {self.min_prefix_blocks}")
        if self.max_prefix_blocks < self.min_prefix_blocks:
            raise ValueError(
                f"--max-prefix-blocks ({self.max_prefix_blocks}) must be >= --min-prefix-blocks "
                f"({self.min_prefix_blocks})"
            )
        if self.tail_tokens <= 0:
            raise ValueError(f"--tail-tokens must be positive, got {self.tail_tokens}")
        if not (math.isfinite(self.tail_sigma) and self.tail_sigma >= 0):
            raise ValueError(f"--tail-sigma must be a finite number >= 0, got {self.tail_sigma}")
        if self.max_tail_tokens < self.tail_tokens:
            raise ValueError(
                f"--max-tail-tokens ({self.max_tail_tokens}) must be >= --tail-tokens ({self.tail_tokens})"
            )
        if not 0 < self.output_tokens <= MAX_OUTPUT_TOKENS:
            raise ValueError(f"--output-tokens must be in 1..{MAX_OUTPUT_TOKENS}, got {self.output_tokens}")


def generate(config: SkewedTraceConfig) -> list[dict[str, object]]:
    """The trace's requests in timestamp order, as Mooncake-format dicts."""
    config.validate()
    rng = np.random.default_rng(config.seed)
    n = config.requests

    # Prefix lengths, log-uniform over [min, max] blocks; popularity by rank, independent of length.
    low, high = math.log(config.min_prefix_blocks), math.log(config.max_prefix_blocks + 1)
    prefix_blocks = np.floor(np.exp(rng.uniform(low, high, config.prefixes))).astype(np.int64)
    prefix_blocks = np.clip(prefix_blocks, config.min_prefix_blocks, config.max_prefix_blocks)
    weights = 1.0 / np.arange(1, config.prefixes + 1, dtype=np.float64) ** config.zipf
    chosen = rng.choice(config.prefixes, size=n, p=weights / weights.sum())

    gaps = rng.exponential(1.0 / config.rate, n)
    seconds = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    timestamps = np.round(seconds * 1000.0).astype(np.int64)

    tails = rng.lognormal(math.log(config.tail_tokens), config.tail_sigma, n)
    tails = np.clip(np.round(tails), 1, config.max_tail_tokens).astype(np.int64)
    outputs = rng.lognormal(math.log(config.output_tokens), OUTPUT_SIGMA, n)
    outputs = np.clip(np.round(outputs), 1, MAX_OUTPUT_TOKENS).astype(np.int64)

    next_id = 0
    prefix_ids: dict[int, list[int]] = {}  # numbered on first use, like Mooncake's ids
    trace = []
    for i in range(n):
        prefix = int(chosen[i])
        if prefix not in prefix_ids:
            length = int(prefix_blocks[prefix])
            prefix_ids[prefix] = list(range(next_id, next_id + length))
            next_id += length
        tail_blocks = -(-int(tails[i]) // BLOCK_TOKENS)
        ids = prefix_ids[prefix] + list(range(next_id, next_id + tail_blocks))
        next_id += tail_blocks
        trace.append(
            {
                "timestamp": int(timestamps[i]),
                "input_length": len(prefix_ids[prefix]) * BLOCK_TOKENS + int(tails[i]),
                "output_length": int(outputs[i]),
                "hash_ids": ids,
            }
        )
    return trace


def write_trace(path: Path, config: SkewedTraceConfig) -> int:
    """Write the trace to `path` as JSON lines; returns the number of requests."""
    trace = generate(config)
    path.write_text("".join(json.dumps(request) + "\n" for request in trace))
    return len(trace)


def main() -> None:
    defaults = SkewedTraceConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--prefixes", type=int, default=defaults.prefixes, help="number of shared prefixes")
    parser.add_argument("--zipf", type=float, default=defaults.zipf, help="popularity exponent (0 = uniform)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="mean arrivals per second (Poisson)")
    parser.add_argument("--min-prefix-blocks", type=int, default=defaults.min_prefix_blocks)
    parser.add_argument("--max-prefix-blocks", type=int, default=defaults.max_prefix_blocks)
    parser.add_argument("--tail-tokens", type=int, default=defaults.tail_tokens, help="median unique tail")
    parser.add_argument("--tail-sigma", type=float, default=defaults.tail_sigma, help="log-normal sigma of the tail")
    parser.add_argument("--max-tail-tokens", type=int, default=defaults.max_tail_tokens)
    parser.add_argument("--output-tokens", type=int, default=defaults.output_tokens, help="median output length")
    args = parser.parse_args()
    config = SkewedTraceConfig(
        requests=args.requests,
        prefixes=args.prefixes,
        zipf=args.zipf,
        seed=args.seed,
        rate=args.rate,
        min_prefix_blocks=args.min_prefix_blocks,
        max_prefix_blocks=args.max_prefix_blocks,
        tail_tokens=args.tail_tokens,
        tail_sigma=args.tail_sigma,
        max_tail_tokens=args.max_tail_tokens,
        output_tokens=args.output_tokens,
    )
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    if not args.out.parent.is_dir():
        parser.error(f"--out: directory {args.out.parent} does not exist")
    count = write_trace(args.out, config)
    print(json.dumps({"out": str(args.out), "requests": count}))


if __name__ == "__main__":
    main()
