"""Random token prompts: lengths drawn uniformly around the asked ones, optionally behind one prefix
that every prompt shares."""

import numpy as np

from bench.serve.datasets.request import BenchRequest, DatasetError


def random_requests(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    ordinary_ids: np.ndarray,
    seed: int,
) -> list[BenchRequest]:
    """Prompt i is the shared prefix (`prefix_len` tokens) plus its own tokens, whose count, like the
    output length, is drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise DatasetError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
    rng = np.random.default_rng(seed)
    prefix = rng.choice(ordinary_ids, size=prefix_len)
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(
            prompt_ids=np.concatenate([prefix, rng.choice(ordinary_ids, size=int(length))]),
            output_len=int(output),
        )
        for length, output in zip(input_lens, output_lens)
    ]


def _uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> np.ndarray:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high, size=count, endpoint=True)
