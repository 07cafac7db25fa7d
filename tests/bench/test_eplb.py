import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.eplb_deepseek_peer import deepseek_placement
from bench.eplb_loads import LoadsConfig, main, make_loads
from workers.eplb import layer_balance, place_experts
from workers.eplb.balance import replica_counts

REPO_ROOT = Path(__file__).resolve().parents[2]
SIZES = ["--layers", "4", "--experts", "16", "--gpus", "4", "--slots", "24", "--tokens", "2000"]


def run_eplb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.eplb", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def loads_file(tmp_path) -> Path:
    path = tmp_path / "loads.json"
    main(["--out", str(path), "--seed", "5", *SIZES])
    return path


def test_loads_file_has_the_issue_shape_and_repeats_by_seed(loads_file, tmp_path):
    data = json.loads(loads_file.read_text())
    again = tmp_path / "again.json"
    main(["--out", str(again), "--seed", "5", *SIZES])

    assert {key: data[key] for key in ("layers", "experts", "gpus", "slots")} == {
        "layers": 4,
        "experts": 16,
        "gpus": 4,
        "slots": 24,
    }
    assert np.asarray(data["base"]).shape == np.asarray(data["drift"]).shape == (4, 16)
    assert np.asarray(data["base"]).sum(axis=1).tolist() == [16000] * 4
    assert data["base"] != data["drift"]
    assert json.loads(again.read_text()) == data


def test_cli_places_saves_and_migrates(loads_file, tmp_path):
    saved = tmp_path / "placement.json"

    first = run_eplb(
        "--loads", str(loads_file), "--which", "base", "--gpus", "4", "--slots", "24", "--save-placement", str(saved)
    )
    second = run_eplb(
        "--loads",
        str(loads_file),
        "--which",
        "drift",
        "--gpus",
        "4",
        "--slots",
        "24",
        "--previous-placement",
        str(saved),
    )

    assert first.returncode == 0, first.stderr
    base = json.loads(first.stdout)
    assert first.stdout.count("\n") == 1
    assert set(base) == {"max_over_mean", "worst_layer", "seconds", "slots_changed"}
    assert base["slots_changed"] is None
    assert 1.0 <= base["max_over_mean"] <= base["worst_layer"]
    placement = np.asarray(json.loads(saved.read_text()))
    assert placement.shape == (4, 4, 6)
    assert (replica_counts(placement, 16) >= 1).all()
    assert second.returncode == 0, second.stderr
    drift = json.loads(second.stdout)
    assert 0.0 <= drift["slots_changed"] < 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "5", "--slots", "24"], "slots (24) must be divisible by gpus (5)"),
        (["--gpus", "4", "--slots", "8"], "slots (8) must be at least the number of experts (16)"),
    ],
)
def test_cli_refuses_bad_sizes(loads_file, args, message):
    refused = run_eplb("--loads", str(loads_file), "--which", "base", *args)

    assert refused.returncode == 2
    assert message in refused.stderr
    assert refused.stdout == ""


def test_cli_refuses_bad_files(loads_file, tmp_path):
    floats = tmp_path / "floats.json"
    floats.write_text(json.dumps({"base": [[1.5, 2.0]], "drift": [[1, 2]]}))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([[[0, 1]]]))

    for args, message in [
        (["--loads", str(floats), "--which", "base", "--gpus", "1", "--slots", "2"], "integer token counts"),
        (["--loads", str(tmp_path / "missing.json"), "--which", "base", "--gpus", "1", "--slots", "2"], "--loads"),
        (
            [
                "--loads",
                str(loads_file),
                "--which",
                "drift",
                "--gpus",
                "4",
                "--slots",
                "24",
                "--previous-placement",
                str(wrong),
            ],
            "placement must have shape [4, 4, 6]",
        ),
    ]:
        refused = run_eplb(*args)
        assert refused.returncode == 2
        assert message in refused.stderr


def test_ours_is_no_worse_balanced_than_the_deepseek_peer():
    for seed in (0, 1):
        data = make_loads(LoadsConfig(seed=seed, layers=8, experts=64, gpus=16, slots=80, tokens=8192))
        base = np.asarray(data["base"])

        ours = layer_balance(place_experts(base, gpus=16, slots=80), base)
        peer = layer_balance(deepseek_placement(base, gpus=16, slots=80).numpy(), base)

        assert ours.mean() <= peer.mean()
