"""Where kernels use programmatic dependent launch (kernels.pdl)."""

import pytest
import torch

from kernels.pdl import pdl_enabled


def test_off_the_gpu_no_kernel_uses_pdl():
    assert not pdl_enabled(torch.device("cpu"))


def test_the_triton_interpreter_never_uses_pdl(monkeypatch):
    # griddepcontrol is a PTX instruction: interpreted kernels would fail on it.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))


@pytest.mark.gpu
def test_hopper_kernels_use_pdl():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
