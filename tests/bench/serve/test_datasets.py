import json

import numpy as np
import pytest

from bench.serve.datasets.mooncake import mooncake_requests, read_trace
from bench.serve.datasets.multiturn import multiturn_requests
from bench.serve.datasets.random_prompts import random_requests
from bench.serve.datasets.request import DatasetError
from bench.serve.datasets.sharegpt import read_sharegpt, sharegpt_requests

ORDINARY = np.arange(100, 1100)


def write_trace(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_random_prompts_share_the_prefix_and_draw_lengths_in_range(word_tokenizer):
    requests = random_requests(
        num_prompts=50,
        input_len=20,
        output_len=10,
        range_ratio=0.5,
        prefix_len=8,
        ordinary_ids=word_tokenizer.ordinary_ids,
        seed=3,
    )

    prefixes = {tuple(request.prompt_ids[:8]) for request in requests}
    assert len(prefixes) == 1
    assert all(8 + 10 <= len(request.prompt_ids) <= 8 + 30 for request in requests)
    assert all(5 <= request.output_len <= 15 for request in requests)
    assert len({len(request.prompt_ids) for request in requests}) > 1
    # The word tokenizer's ids 0 and 1 are its special tokens.
    assert not any(np.isin([0, 1], request.prompt_ids).any() for request in requests)


def test_random_prompts_repeat_with_the_seed_and_change_without_it():
    def prompts(seed):
        return [
            r.prompt_ids.tolist()
            for r in random_requests(
                num_prompts=4,
                input_len=16,
                output_len=4,
                range_ratio=0.0,
                prefix_len=0,
                ordinary_ids=ORDINARY,
                seed=seed,
            )
        ]

    assert prompts(1) == prompts(1)
    assert prompts(1) != prompts(2)
    assert all(len(prompt) == 16 for prompt in prompts(1))


def test_a_random_range_ratio_of_one_is_refused():
    with pytest.raises(DatasetError, match="--random-range-ratio"):
        random_requests(
            num_prompts=1, input_len=16, output_len=4, range_ratio=1.0, prefix_len=0, ordinary_ids=ORDINARY, seed=0
        )


def sharegpt_file(tmp_path, entries):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_takes_the_first_human_turn_and_the_answers_length(tmp_path, word_tokenizer):
    path = sharegpt_file(
        tmp_path,
        [
            {
                "conversations": [
                    {"from": "system", "value": "w9 w9 w9 w9"},
                    {"from": "human", "value": "w1 w2 w3 w4 w5"},
                    {"from": "gpt", "value": "w6 w7 w8 w9 w10 w11"},
                    {"from": "human", "value": "w12 w13 w14 w15"},
                    {"from": "gpt", "value": "w16 w17 w18 w19"},
                ]
            },
            {"conversations": [{"from": "human", "value": "w1 w2 w3 w4"}]},  # no answer
            {"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3 w4 w5 w6"}]},
        ],
    )

    [request] = sharegpt_requests(path, num_prompts=10, tokenizer=word_tokenizer, seed=0)

    assert request.text == "w1 w2 w3 w4 w5"
    assert request.prompt_ids.tolist() == [3, 4, 5, 6, 7]
    assert request.output_len == 6


def test_sharegpt_limits_and_a_fixed_output_length(tmp_path, word_tokenizer):
    answer = " ".join(["w1"] * 10)
    path = sharegpt_file(
        tmp_path,
        [
            {"conversations": [{"from": "human", "value": " ".join(["w2"] * n)}, {"from": "gpt", "value": answer}]}
            for n in (4, 8, 12)
        ],
    )

    kept = sharegpt_requests(path, num_prompts=10, tokenizer=word_tokenizer, seed=0, max_input_len=8, max_total_len=100)
    fixed = sharegpt_requests(path, num_prompts=10, tokenizer=word_tokenizer, seed=0, output_len=5, max_total_len=13)

    assert sorted(len(r.prompt_ids) for r in kept) == [4, 8]
    assert sorted((len(r.prompt_ids), r.output_len) for r in fixed) == [(4, 5), (8, 5)]


@pytest.mark.parametrize(
    ("content", "fault"),
    [
        ("not json", "cannot read a ShareGPT JSON file"),
        ('{"conversations": []}', "a JSON list of conversations"),
        ('[{"conversations": [{"from": "human"}]}]', "entry 0 is not"),
        ('[{"turns": []}]', "entry 0 is not"),
        ('[{"conversations": [{"from": "gpt", "value": "w1"}]}]', "no conversation has a human turn"),
    ],
)
def test_bad_sharegpt_files_are_refused_naming_the_file(tmp_path, content, fault):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=fault) as refused:
        read_sharegpt(path)
    assert str(path) in str(refused.value)


def test_mooncake_hash_ids_are_shared_token_blocks_cut_to_the_input_length(tmp_path):
    path = write_trace(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 12, "output_length": 5, "hash_ids": [0, 1, 3]},
            {"timestamp": 3000, "input_length": 4, "output_length": 1, "hash_ids": [3]},
        ],
    )

    first, second, third = mooncake_requests(
        read_trace(path), block_size=4, ordinary_ids=ORDINARY, seed=0, num_prompts=None
    )

    assert len(first.prompt_ids) == 10 and len(second.prompt_ids) == 12 and len(third.prompt_ids) == 4
    assert first.prompt_ids[:8].tolist() == second.prompt_ids[:8].tolist()
    assert first.prompt_ids[8:10].tolist() != second.prompt_ids[8:10].tolist()  # blocks 2 and 3 differ
    assert second.prompt_ids[8:12].tolist() == third.prompt_ids.tolist()  # block 3, wherever it appears
    assert [r.output_len for r in (first, second, third)] == [3, 5, 1]
    assert [r.arrival_s for r in (first, second, third)] == [0.0, 0.5, 2.0]


def test_mooncake_blocks_do_not_depend_on_which_request_named_them_first(tmp_path):
    line = {"timestamp": 0, "input_length": 8, "output_length": 1}
    path = write_trace(tmp_path / "trace.jsonl", [{**line, "hash_ids": [7, 8]}, {**line, "hash_ids": [9, 7]}])
    alone = write_trace(tmp_path / "alone.jsonl", [{**line, "hash_ids": [9, 7]}])

    in_trace = mooncake_requests(read_trace(path), block_size=4, ordinary_ids=ORDINARY, seed=0, num_prompts=None)
    by_itself = mooncake_requests(read_trace(alone), block_size=4, ordinary_ids=ORDINARY, seed=0, num_prompts=None)

    assert in_trace[1].prompt_ids.tolist() == by_itself[0].prompt_ids.tolist()


def test_a_smaller_block_size_shrinks_mooncake_prompts_and_num_prompts_takes_the_first(tmp_path):
    path = write_trace(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 0, "input_length": 1000, "output_length": 2, "hash_ids": [0, 1]},
            {"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]},
        ],
    )

    [request] = mooncake_requests(read_trace(path), block_size=16, ordinary_ids=ORDINARY, seed=0, num_prompts=1)

    assert len(request.prompt_ids) == 32


@pytest.mark.parametrize(
    ("line", "fault"),
    [
        ("{not json", ":2: not JSON"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1}', ":2: a trace line needs"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', ":2: timestamp must be"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": []}', ":2: timestamp must be"),
        ('{"timestamp": "x", "input_length": 4, "output_length": 1, "hash_ids": [1]}', ":2: timestamp must be"),
    ],
)
def test_bad_mooncake_lines_are_refused_with_their_line_number(tmp_path, line, fault):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(DatasetError, match=fault):
        read_trace(path)


def test_a_missing_or_empty_trace_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_multiturn_turns_extend_the_previous_prompt_exactly():
    requests = multiturn_requests(
        sessions=3, turns=4, first_turn_len=10, turn_len=5, output_len=2, ordinary_ids=ORDINARY, seed=0
    )

    assert len(requests) == 12
    # Turn by turn: every session's first turn, then every second turn, ...
    assert [r.session_id for r in requests] == [0, 1, 2] * 4
    for session in range(3):
        turns = [r.prompt_ids.tolist() for r in requests if r.session_id == session]
        assert [len(turn) for turn in turns] == [10, 15, 20, 25]
        assert all(later[: len(earlier)] == earlier for earlier, later in zip(turns, turns[1:]))
    first_turns = {tuple(r.prompt_ids.tolist()) for r in requests[:3]}
    assert len(first_turns) == 3
    assert all(r.output_len == 2 for r in requests)


def test_multiturn_settings_are_checked():
    with pytest.raises(DatasetError, match="--sessions"):
        multiturn_requests(
            sessions=0, turns=2, first_turn_len=4, turn_len=4, output_len=1, ordinary_ids=ORDINARY, seed=0
        )
