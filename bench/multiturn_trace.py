"""Write a reproducible multi-turn conversation trace in the Mooncake format, for `bench.trace_replay`.

    python -m bench.multiturn_trace --out FILE [--shape chat|agent|docs] [--seed 0] [--sessions N]

The model. Sessions start as a Poisson process. Each session:
- opens with one of a few shared system prompts (Zipf popularity, lengths log-uniform in tokens,
  so the block that straddles the end of the system prompt is already the session's own);
- may paste a document first (`doc_share` of sessions; log-normal length), which only that session
  ever sees again;
- sends turns until it stops: after each turn it goes on with probability `continue_prob`, up to
  `max_turns` and `max_context_tokens`. Turn k's prompt is the system prompt, the document, every
  earlier user message and answer, and the new user message, so it extends turn k-1's prompt and
  answer and reuses all of its full blocks;
- waits between a turn's arrival and the next: decode time (`decode_s_per_token` x answer tokens)
  plus a think time, log-normal with median `think_s` and log-space spread `think_sigma` (heavy
  tailed: at sigma 1.5, one gap in a hundred is 30x the median).
`one_off_share` of sessions are single requests nobody sends again: a document to summarise, or, for
`one_off_shared_share` of them, a question under one of the shared system prompts (an application's
instructions and tools, as in the Mooncake release's own sample: many requests share a long prefix and
end in a tail of their own). Their unique tails are the traffic an admission policy should not keep.

Ids are chained as in Mooncake: a full block's id names the whole prefix up to its end, so a
block is the system prompt's (shared by all its sessions) while it ends inside the system prompt,
and the session's own after that; a prompt's last partial block gets an id never used again. Ids are
numbered in order of first appearance, lines are `{"timestamp": ms, "input_length", "output_length",
"hash_ids"}` in timestamp order, and the same shape and seed give the same file.

Shapes (presets; every field can be overridden from Python):
- `chat`: short messages, think times of tens of seconds, five turns on average;
- `agent`: tool results as long user messages, think times of seconds, long sessions;
- `docs`: many pasted documents and one-off summarisations, few turns;
- `api`: mostly one-off questions under long shared application prompts, a few conversations.
"""

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MultiTurnConfig:
    sessions: int = 800
    seed: int = 0
    session_rate: float = 0.5  # sessions started per second
    system_prompts: int = 6
    system_zipf: float = 1.0
    min_system_tokens: int = 300
    max_system_tokens: int = 6000
    continue_prob: float = 0.8
    max_turns: int = 40
    max_context_tokens: int = 131072
    user_tokens: int = 200  # median
    user_sigma: float = 1.0
    output_tokens: int = 300  # median
    output_sigma: float = 0.8
    think_s: float = 30.0  # median
    think_sigma: float = 1.5
    decode_s_per_token: float = 0.02
    doc_share: float = 0.15
    doc_tokens: int = 6000  # median
    doc_sigma: float = 0.8
    one_off_share: float = 0.1
    one_off_shared_share: float = 0.0  # of one-offs: a shared system prompt and a question, no document

    def validate(self) -> None:
        """Raise ValueError naming the first invalid setting."""
        positive = ("sessions", "session_rate", "system_prompts", "min_system_tokens", "max_turns")
        positive += ("max_context_tokens", "user_tokens", "output_tokens", "think_s", "doc_tokens")
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_system_tokens < self.min_system_tokens:
            raise ValueError(
                f"max_system_tokens ({self.max_system_tokens}) must be >= min_system_tokens ({self.min_system_tokens})"
            )
        for name in ("continue_prob", "doc_share", "one_off_share", "one_off_shared_share"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        for name in ("system_zipf", "user_sigma", "output_sigma", "think_sigma", "doc_sigma", "decode_s_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


SHAPES = {
    "chat": MultiTurnConfig(),
    "agent": MultiTurnConfig(
        sessions=250,
        session_rate=0.15,
        continue_prob=0.94,
        user_tokens=1200,
        user_sigma=1.2,
        output_tokens=150,
        think_s=4.0,
        think_sigma=1.2,
        doc_share=0.05,
        one_off_share=0.05,
    ),  # fmt: skip
    "docs": MultiTurnConfig(
        sessions=1500,
        session_rate=1.0,
        continue_prob=0.6,
        think_s=45.0,
        think_sigma=1.8,
        doc_share=0.5,
        doc_tokens=9000,
        one_off_share=0.3,
    ),  # fmt: skip
    "api": MultiTurnConfig(
        sessions=3000,
        session_rate=2.0,
        min_system_tokens=2000,
        max_system_tokens=12000,
        system_prompts=20,
        continue_prob=0.7,
        doc_share=0.2,
        one_off_share=0.6,
        one_off_shared_share=0.8,
        user_tokens=600,
    ),  # fmt: skip
}


class _Ids:
    """Chained block ids numbered on first appearance: equal owner and position = equal id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int, int], int] = {}

    def get(self, owner: tuple[str, int, int]) -> int:
        return self._ids.setdefault(owner, len(self._ids))

    def fresh(self) -> int:
        return self.get(("partial", len(self._ids), 0))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, low: int = 1) -> int:
    return max(low, round(rng.lognormal(math.log(median), sigma)))


def generate(config: MultiTurnConfig) -> list[dict[str, object]]:
    """The trace's requests in timestamp order, as Mooncake-format dicts."""
    config.validate()
    rng = np.random.default_rng(config.seed)
    low, high = math.log(config.min_system_tokens), math.log(config.max_system_tokens + 1)
    system_tokens = np.floor(np.exp(rng.uniform(low, high, config.system_prompts))).astype(np.int64)
    weights = 1.0 / np.arange(1, config.system_prompts + 1, dtype=np.float64) ** config.system_zipf
    starts = np.cumsum(rng.exponential(1.0 / config.session_rate, config.sessions))
    ids = _Ids()
    requests: list[tuple[float, int, int, list[int]]] = []
    for session, start in enumerate(starts):
        one_off = rng.random() < config.one_off_share
        # Drawn only when asked for, so that shapes without such questions keep their traces.
        question = one_off and config.one_off_shared_share > 0 and rng.random() < config.one_off_shared_share
        if one_off and not question:
            shared, shared_tokens = -1, 0
        else:
            shared = int(rng.choice(config.system_prompts, p=weights / weights.sum()))
            shared_tokens = int(system_tokens[shared])
        context = shared_tokens
        if (one_off and not question) or (not one_off and rng.random() < config.doc_share):
            context += _lognormal(rng, config.doc_tokens, config.doc_sigma)
        now = float(start)
        for turn in range(1 if one_off else config.max_turns):
            prompt = context + _lognormal(rng, config.user_tokens, config.user_sigma)
            output = _lognormal(rng, config.output_tokens, config.output_sigma)
            if prompt > config.max_context_tokens:
                break
            full = prompt // BLOCK_TOKENS
            hash_ids = [
                ids.get(("system", shared, i) if (i + 1) * BLOCK_TOKENS <= shared_tokens else ("session", session, i))
                for i in range(full)
            ]
            if prompt % BLOCK_TOKENS:
                hash_ids.append(ids.fresh())
            requests.append((now, prompt, output, hash_ids))
            context = prompt + output
            if rng.random() >= config.continue_prob:
                break
            now += output * config.decode_s_per_token + rng.lognormal(math.log(config.think_s), config.think_sigma)
    requests.sort(key=lambda request: request[0])
    return _renumbered(requests)


def _renumbered(requests: list[tuple[float, int, int, list[int]]]) -> list[dict[str, object]]:
    """Mooncake-format dicts with ids renumbered in order of first appearance in time."""
    order: dict[int, int] = {}
    return [
        {
            "timestamp": round(seconds * 1000.0),
            "input_length": prompt,
            "output_length": output,
            "hash_ids": [order.setdefault(block_id, len(order)) for block_id in hash_ids],
        }
        for seconds, prompt, output, hash_ids in requests
    ]


def write_trace(path: Path, config: MultiTurnConfig) -> int:
    """Write the trace to `path` as JSON lines; returns the number of requests."""
    trace = generate(config)
    path.write_text("".join(json.dumps(request) + "\n" for request in trace))
    return len(trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="chat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, help="number of sessions (default: the shape's)")
    args = parser.parse_args()
    config = replace(SHAPES[args.shape], seed=args.seed)
    if args.sessions is not None:
        config = replace(config, sessions=args.sessions)
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    if not args.out.parent.is_dir():
        parser.error(f"--out: directory {args.out.parent} does not exist")
    count = write_trace(args.out, config)
    print(json.dumps({"out": str(args.out), "shape": args.shape, "requests": count}))


if __name__ == "__main__":
    main()
