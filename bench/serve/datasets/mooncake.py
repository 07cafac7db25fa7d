"""Mooncake-format traces (one JSON object a line: `timestamp` ms, `input_length`, `output_length`,
`hash_ids`) turned into token prompts whose prefix reuse is real.

Each hash id stands for one block of `block_size` token ids, drawn once from the seed and the id, so
every request naming an id sends the same tokens there; a prompt is its ids' blocks in order, cut to
`input_length`. A `block_size` under the trace's own (512 in Mooncake's release) shrinks the prompts
that way: all of a request's blocks, when they hold fewer than `input_length` tokens. Lines are
replayed in timestamp order, each at its timestamp from the first one's.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.serve.datasets.request import BenchRequest, DatasetError

TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceLine:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> list[TraceLine]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read the trace ({error})") from None
    lines = [_trace_line(path, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise DatasetError(f"{path}: the trace has no requests")
    return sorted(lines, key=lambda line: line.timestamp_ms)


def mooncake_requests(
    lines: list[TraceLine], *, block_size: int, ordinary_ids: np.ndarray, seed: int, num_prompts: int | None
) -> list[BenchRequest]:
    if block_size < 1:
        raise DatasetError(f"--block-size must be >= 1, got {block_size}")
    lines = lines[:num_prompts] if num_prompts is not None else lines
    blocks = _BlockTokens(block_size, ordinary_ids, seed)
    start_ms = lines[0].timestamp_ms
    return [
        BenchRequest(
            prompt_ids=np.concatenate([blocks[hash_id] for hash_id in line.hash_ids])[: line.input_length],
            output_len=line.output_length,
            arrival_s=(line.timestamp_ms - start_ms) / 1000.0,
        )
        for line in lines
    ]


class _BlockTokens:
    """The tokens of each hash id's block, made on first use and kept for the requests that name it again."""

    def __init__(self, block_size: int, ordinary_ids: np.ndarray, seed: int) -> None:
        self._block_size = block_size
        self._ordinary_ids = ordinary_ids
        self._seed = seed
        self._blocks: dict[int, np.ndarray] = {}

    def __getitem__(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            # Seeded by the id itself, so a block's tokens do not depend on which request named it first.
            rng = np.random.default_rng([self._seed, hash_id])
            block = self._blocks[hash_id] = rng.choice(self._ordinary_ids, size=self._block_size)
        return block


def _trace_line(path: Path, number: int, line: str) -> TraceLine:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path}:{number}: not JSON ({error})") from None
    if not isinstance(record, dict) or any(field not in record for field in TRACE_FIELDS):
        raise DatasetError(f"{path}:{number}: a trace line needs {', '.join(TRACE_FIELDS)}")
    timestamp, input_length, output_length, hash_ids = (record[field] for field in TRACE_FIELDS)
    valid = (
        _is_number(timestamp)
        and _is_count(input_length)
        and _is_count(output_length)
        and isinstance(hash_ids, list)
        and hash_ids
        and all(_is_count(hash_id, minimum=0) for hash_id in hash_ids)
    )
    if not valid:
        raise DatasetError(
            f"{path}:{number}: timestamp must be a number, input_length and output_length integers >= 1, "
            "hash_ids a non-empty list of integers >= 0"
        )
    return TraceLine(float(timestamp), input_length, output_length, tuple(hash_ids))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: object, minimum: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
