"""bench.vision_encoder on the CPU at the tiny shape: our tower carries HF's SiglipVisionModel's
weights and gives its output, every batch gets a row of all three variants, bad arguments are
refused, and without CUDA the GPU default says so instead of crashing."""

import json

import pytest
import torch

from bench.vision_encoder import SHAPES, build_models, main, parse_args


def test_a_tiny_cpu_run_agrees_with_hf_and_reports_every_batch(capsys):
    assert main(["--device", "cpu", "--shape", "tiny", "--batches", "1,3", "--repeats", "2", "--warmup", "1"]) == 0
    result = json.loads(capsys.readouterr().out)

    assert result["agreement"]["max_abs_diff"] <= 1e-5
    assert result["agreement"]["max_abs_reference"] > 0
    assert result["vision"]["patches_per_tile"] == 16 and result["connector"]["embeddings_per_tile"] == 4
    assert [row["batch_tiles"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["patches"] == 16 * row["batch_tiles"]
        for variant in ("ours_tower", "hf_tower", "ours_encoder"):
            assert row[f"{variant}_ms"] > 0 and row[f"{variant}_patches_per_s"] > 0
    assert set(result["ratios"]["tower_speedup_over_hf"]) == {"1", "3"}


def test_the_weights_reach_our_tower_through_the_checkpoint_names():
    """A tensor left out of the copy would keep our random init and show as a difference."""
    hf, ours = build_models(SHAPES["tiny"], torch.device("cpu"), torch.float32, seed=1)
    hf_tower = getattr(hf, "vision_model", hf)

    for name, tensor in hf_tower.state_dict().items():
        assert torch.equal(ours.vision_model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "argv", [["--batches", "0,2"], ["--batches", "one"], ["--shape", "so100m"], ["--repeats", "0"]]
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
def test_without_cuda_the_default_device_exits_2_with_a_message(capsys):
    assert main(["--shape", "tiny"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
