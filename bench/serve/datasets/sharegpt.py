"""ShareGPT conversations as vLLM's serving benchmark reads them: each conversation's first human
turn is a prompt, the token length of the answer after it the output length.

A file is a JSON list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value":
...}, ...]}`. Conversations are shuffled with the seed; one whose prompt or answer is under 4 tokens,
whose prompt is over `max_input_len` tokens, or whose prompt plus answer is over `max_total_len`, is
skipped (vLLM's filter). `output_len` replaces every answer's length.
"""

import json
from pathlib import Path

import numpy as np

from bench.serve.datasets.request import BenchRequest, DatasetError
from bench.serve.tokenizer import BenchTokenizer

MIN_TOKENS = 4


def sharegpt_requests(
    path: Path,
    *,
    num_prompts: int,
    tokenizer: BenchTokenizer,
    seed: int,
    output_len: int | None = None,
    max_input_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    pairs = read_sharegpt(path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests = []
    for index in order:
        prompt, answer = pairs[index]
        prompt_ids = tokenizer.encode(prompt)
        answer_len = output_len if output_len is not None else len(tokenizer.encode(answer))
        too_short = len(prompt_ids) < MIN_TOKENS or answer_len < MIN_TOKENS
        too_long = len(prompt_ids) > max_input_len or len(prompt_ids) + answer_len > max_total_len
        if too_short or too_long:
            continue
        requests.append(
            BenchRequest(prompt_ids=np.array(prompt_ids, dtype=np.int64), output_len=answer_len, text=prompt)
        )
        if len(requests) == num_prompts:
            break
    if not requests:
        raise DatasetError(f"{path}: no conversation fits the length limits")
    return requests


def read_sharegpt(path: Path) -> list[tuple[str, str]]:
    """Each conversation's first human turn and the gpt turn after it; conversations without both are left out."""
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(f"{path}: cannot read a ShareGPT JSON file ({error})") from None
    if not isinstance(entries, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for number, entry in enumerate(entries):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not all(_is_turn(turn) for turn in turns):
            raise DatasetError(
                f'{path}: entry {number} is not {{"conversations": [{{"from": ..., "value": "..."}}, ...]}}'
            )
        pair = _first_exchange(turns)
        if pair is not None:
            pairs.append(pair)
    if not pairs:
        raise DatasetError(f"{path}: no conversation has a human turn followed by a gpt turn")
    return pairs


def _is_turn(turn: object) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)


def _first_exchange(turns: list[dict]) -> tuple[str, str] | None:
    for turn, reply in zip(turns, turns[1:]):
        if turn["from"] == "human":
            return (turn["value"], reply["value"]) if reply["from"] == "gpt" else None
    return None
