"""The KV cache sized from a CUDA device by gpu_memory_utilization (run on the accelerator machine:
`pytest -m gpu`). These tests assume no other process uses the device while they run, and they run in
a pytest process of their own (bench/gpu.sh does): they measure this process's device memory outside
torch, which other tests' NCCL groups and compiled kernels would add to."""

import gc
import logging

import pytest
import torch

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.engine import LLM, SamplingParams
from workers.engine.sizing.memory_profile import NON_TORCH_BYTES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GiB = 1 << 30
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [(i * 31) % 49152 for i in range(100)]


@pytest.fixture(autouse=True)
def released():
    """What earlier tests of this process left in torch's cache is given back to the device."""
    gc.collect()
    torch.cuda.empty_cache()


def kv_bytes(llm: LLM) -> int:
    return sum(keys.nbytes + values.nbytes for keys, values in llm.engine.runner.kv_cache.layers)


def non_torch_bytes() -> int:
    """This process's device memory outside torch's allocator (the device is this process's alone)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def test_an_engine_takes_half_the_device_and_serves_within_it(caplog):
    _, total = torch.cuda.mem_get_info()
    held_before = torch.cuda.memory_reserved()  # other engines this process still holds

    with caplog.at_level(logging.INFO, logger="workers.engine.engine"):
        llm = LLM(SMOLLM2_135M_CONFIG, device="cuda", seed=0, gpu_memory_utilization=0.5)
    outputs = llm.generate([PROMPT, PROMPT[:37]], GREEDY)
    torch.cuda.synchronize()

    assert [len(output.token_ids) for output in outputs] == [16, 16]
    assert llm.engine.runner.graphs is not None  # captured after the KV cache, within the share
    # Everything torch held for this engine at its peak (weights, KV cache, activations, CUDA graphs,
    # the start-up profile) and the memory outside torch stay within half the device.
    engine_peak = torch.cuda.max_memory_reserved() - held_before
    assert non_torch_bytes() <= NON_TORCH_BYTES, "NON_TORCH_BYTES underestimates this device's CUDA context"
    assert engine_peak + non_torch_bytes() <= 0.5 * total
    # The measured activations and graphs of a 135M model leave the KV cache nearly all that is left.
    weights = sum(p.nbytes for p in llm.engine.runner.model.parameters())
    assert kv_bytes(llm) >= 0.5 * total - NON_TORCH_BYTES - weights - 2 * GiB
    old_default = (1 << 30) // llm.engine.kv_cache.specs.page_bytes
    assert llm.engine.stats().num_pages > 10 * old_default
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: ")]
    assert len(logged) == 1 and "tokens (" in logged[0] and "= 0.5 of " in logged[0]


def test_a_share_the_device_cannot_give_is_refused():
    held = LLM(SMOLLM2_135M_CONFIG, device="cuda", seed=0, gpu_memory_utilization=0.5)

    with pytest.raises(RuntimeError, match="gpu_memory_utilization=0.6 "):
        LLM(SMOLLM2_135M_CONFIG, device="cuda", seed=1, gpu_memory_utilization=0.6)

    assert held.generate([PROMPT], GREEDY)[0].token_ids


def test_two_engines_with_a_quarter_each_fit_side_by_side():
    _, total = torch.cuda.mem_get_info()
    held_before = torch.cuda.memory_reserved()

    first = LLM(SMOLLM2_135M_CONFIG, device="cuda", seed=0, gpu_memory_utilization=0.25)
    second = LLM(SMOLLM2_135M_CONFIG, device="cuda", seed=1, gpu_memory_utilization=0.25)

    # The second sizes from its own share, not from what the first already holds.
    assert second.engine.stats().num_pages >= 0.95 * first.engine.stats().num_pages
    for llm in (first, second):
        assert [len(output.token_ids) for output in llm.generate([PROMPT, PROMPT[:50]], GREEDY)] == [16, 16]
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_reserved() - held_before + non_torch_bytes() <= 0.5 * total
