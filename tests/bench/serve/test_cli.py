"""The command refuses bad flags and unreadable inputs with argparse's one-line error, before any load."""

import json

import pytest

from bench.serve.cli import main
from bench.serve.tokenizer import BenchTokenizer

SERVER = ["--base-url", "http://127.0.0.1:9", "--model", "m"]


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("python -m bench.serve: error: ")
    return last_line


def test_unreadable_dataset_files_are_refused_in_one_line(capsys, tmp_path, tokenizer_dir):
    tokenizer = ["--tokenizer", str(tokenizer_dir)]
    missing = tmp_path / "missing.jsonl"
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"timestamp": 0, "input_length": 4}\n')
    bad_sharegpt = tmp_path / "bad.json"
    bad_sharegpt.write_text("[1, 2]")

    assert f"{missing}: cannot read the trace" in refusal(
        capsys, [*SERVER, *tokenizer, "--dataset", "mooncake", "--dataset-path", str(missing)]
    )
    assert f"{bad_trace}:1: a trace line needs" in refusal(
        capsys, [*SERVER, *tokenizer, "--dataset", "mooncake", "--dataset-path", str(bad_trace)]
    )
    assert f"{bad_sharegpt}: entry 0 is not" in refusal(
        capsys, [*SERVER, *tokenizer, "--dataset", "sharegpt", "--dataset-path", str(bad_sharegpt)]
    )


@pytest.mark.parametrize(
    ("flags", "fault"),
    [
        (["--dataset", "mooncake"], "--dataset mooncake needs --dataset-path"),
        (["--dataset", "multiturn", "--num-prompts", "3"], "drop --num-prompts"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be > 0"),
        (["--slo", "ttft=fast"], "needs a number of ms"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
        (["--tokenizer", "/nowhere/at/all"], "neither a directory with tokenizer.json"),
    ],
)
def test_bad_flags_are_refused_in_one_line(capsys, tokenizer_dir, flags, fault):
    argv = [*SERVER, "--tokenizer", str(tokenizer_dir), *flags]
    assert fault in refusal(capsys, argv)


def test_a_tokenizer_directory_loads_without_its_special_tokens_in_the_random_range(tokenizer_dir):
    tokenizer = BenchTokenizer.load(str(tokenizer_dir))

    assert tokenizer.vocab_size == 53
    assert tokenizer.ordinary_ids.tolist() == list(range(2, 53))
    assert tokenizer.decode(tokenizer.ordinary_ids[:3]) == "w0 w1 w2"


def test_a_run_against_no_server_reports_its_failures(capsys, tmp_path, tokenizer_dir):
    output = tmp_path / "report.json"

    report = main(
        [
            *SERVER,
            "--tokenizer",
            str(tokenizer_dir),
            "--num-prompts",
            "3",
            "--random-input-len",
            "8",
            "--random-output-len",
            "2",
            "--output",
            str(output),
            "--no-progress",
        ]
    )

    assert (report["completed"], report["failed"]) == (0, 3)
    assert report["errors"] and report["errors"][0].startswith("ConnectError")
    assert report["prefix_cache"]["server_hit_rate"] is None
    assert json.loads(capsys.readouterr().out) == report == json.loads(output.read_text())
