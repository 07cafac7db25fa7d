"""bench.fp8_gemm's command line: the defaults cover Llama-3.1-8B's four projections over 1 .. 8192
tokens, bad shapes and token counts are refused, the bandwidth comes from the device's name, and
without CUDA it says so and exits 2 rather than crashing."""

import pytest
import torch

from bench.fp8_gemm import SHAPES, TOKENS, hbm_bandwidth, main, parse_args


def test_defaults_are_every_projection_at_every_token_count():
    args = parse_args([])
    assert args.shapes == list(SHAPES) and args.tokens == list(TOKENS) and not args.sweep
    assert parse_args(["--tokens", "1,64", "--shapes", "down", "--sweep"]).tokens == [1, 64]


@pytest.mark.parametrize("argv", [["--shapes", "qkv,lm_head"], ["--tokens", "0,4"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2


def test_bandwidth_follows_the_device_name():
    assert hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert hbm_bandwidth("NVIDIA A10G") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
def test_without_cuda_it_exits_2_with_a_message(capsys):
    assert main(["--tokens", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
