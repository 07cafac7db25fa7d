"""Sizing the KV cache: --num-pages, --kv-cache-bytes, and on CUDA the device's share
(gpu_memory_utilization) less what the engine measured it needs besides (the CUDA measurement itself
is in test_kv_sizing_cuda)."""

import logging

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.args import CPU_KV_CACHE_BYTES, EngineArgs
from workers.engine import LLM
from workers.engine.builder import engine_config
from workers.engine.config import EngineConfig
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.model_loader import load_model
from workers.engine.runner.model_runner import ModelRunner
from workers.engine.sizing import kv_sizing
from workers.engine.sizing.kv_sizing import kv_cache_size
from workers.engine.sizing.memory_profile import (
    DeviceMemory,
    profile_prompt_lengths,
    run_largest_step,
    temporary_num_pages,
)

GiB = 1 << 30
CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named: these tests never touch a CUDA device


@pytest.fixture(scope="module")
def loaded():
    return load_model(TINY_CONFIGS["llama"], device=CPU, dtype=torch.float32, seed=0, max_model_len=None)


def bytes_per_page(loaded) -> int:
    return KVCacheSpecs.of_model(loaded.config, dtype=torch.float32, page_size=16).page_bytes


def settings(**settings) -> EngineConfig:
    return engine_config(EngineArgs(model=TINY_CONFIGS["llama"], **settings))


def memory(**fields) -> DeviceMemory:
    numbers = {
        "total": 80 * GiB,
        "utilization": 0.5,
        "non_torch": 1 * GiB,
        "weights": 15 * GiB,
        "activations": 2 * GiB,
        "cuda_graphs": GiB // 2,
        **fields,
    }
    return DeviceMemory(**numbers)


def test_the_kv_cache_takes_what_the_share_leaves():
    assert memory().kv_bytes() == 40 * GiB - (1 * GiB + 15 * GiB + 2 * GiB + GiB // 2)
    assert memory(utilization=0.25, cuda_graphs=0).kv_bytes() == 20 * GiB - 18 * GiB


def test_the_arithmetic_is_described_term_by_term():
    described = memory(utilization=0.45).describe()

    assert described == (
        "0.45 of 80.0 GiB − weights 15.0 GiB − activations 2.0 GiB − CUDA graphs 512.0 MiB"
        " − outside torch 1.0 GiB (estimated)"
    )


@pytest.mark.parametrize("utilization", [0.2, 18.5 / 80])
def test_a_share_that_leaves_no_kv_cache_is_refused_naming_the_setting_and_numbers(utilization):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization={utilization:g}") as refused:
        memory(utilization=utilization).kv_bytes()

    assert "weights 15.0 GiB" in str(refused.value) and "of 80.0 GiB" in str(refused.value)


@pytest.mark.parametrize(
    ("batched", "seqs", "window", "expected"),
    [
        (2048, 64, 4096, [1985] + [1] * 63),  # one long prompt, every other row samples
        (8, 64, 4096, [1] * 8),  # fewer tokens than requests: one token each
        (2048, 4, 100, [99] * 4),  # the window caps every prompt: the largest step is smaller
        (300, 4, 101, [100, 100, 99, 1]),
    ],
)
def test_the_profiled_step_is_the_largest_the_engine_schedules(batched, seqs, window, expected):
    lengths = profile_prompt_lengths(max_num_batched_tokens=batched, max_num_seqs=seqs, max_model_len=window)

    assert lengths == expected


@pytest.mark.parametrize("backend", ["torch_blockwise", "triton"])  # the reference path, the device path
def test_the_profiled_step_runs_every_token_through_the_runner_in_one_step(backend):
    loaded = load_model(TINY_CONFIGS["llama"], device=CPU, dtype=torch.float32, seed=0, max_model_len=None)
    lengths = profile_prompt_lengths(max_num_batched_tokens=40, max_num_seqs=4, max_model_len=loaded.max_model_len)
    num_pages = temporary_num_pages(lengths, 16)
    kv_cache = KVCache.for_model(loaded.config, num_pages=num_pages, page_size=16, dtype=torch.float32, device=CPU)
    runner = ModelRunner(loaded.model, kv_cache, attention_backend=backend, device=CPU, seed=0, max_num_seqs=4)

    computed = run_largest_step(runner, lengths, vocab_size=loaded.config.vocab_size)

    assert computed == runner.num_computed_tokens == 40
    assert num_pages == 1 + 3 + 3  # the reserved page, 37 tokens, three of one
    if backend == "triton":
        assert runner.batch.extras is not None  # the costliest sampling mode allocates the rows' history


def test_the_cpu_keeps_its_one_gib_whatever_the_utilization(loaded, monkeypatch, caplog):
    monkeypatch.setattr(kv_sizing, "profile_device_memory", _not_on_this_device)
    expected = CPU_KV_CACHE_BYTES // bytes_per_page(loaded)

    for utilization in (0.9, 0.1):
        size = kv_cache_size(loaded, settings(gpu_memory_utilization=utilization), dtype=torch.float32, device=CPU)
        assert size.num_pages == expected
    with caplog.at_level(logging.INFO, logger="workers.engine.engine"):
        engine = LLM(TINY_CONFIGS["llama"], seed=0, gpu_memory_utilization=0.1).engine

    assert engine.stats().num_pages == expected - 1  # one page is reserved
    tokens = (expected - 1) * 16
    assert f"KV cache: {tokens:,} tokens (1.0 GiB) from 1.0 GiB off CUDA" in caplog.messages


def test_explicit_sizes_win_over_the_device(loaded, monkeypatch):
    monkeypatch.setattr(kv_sizing, "profile_device_memory", _not_on_this_device)

    by_pages = kv_cache_size(loaded, settings(num_pages=40), dtype=torch.float32, device=CUDA)
    by_bytes = kv_cache_size(loaded, settings(kv_cache_bytes=1 << 20), dtype=torch.float32, device=CUDA)

    assert by_pages.num_pages == 40
    page_bytes = bytes_per_page(loaded)
    assert by_bytes.num_pages == (1 << 20) // page_bytes
    assert str(by_bytes) == f"{by_bytes.num_tokens:,} tokens (1.0 MiB) from kv_cache_bytes"


def test_on_cuda_the_pages_are_what_the_measured_budget_leaves(loaded, monkeypatch):
    measured = memory(total=8 * GiB, weights=GiB, activations=GiB // 4, cuda_graphs=GiB // 8, non_torch=GiB // 2)
    checked = []
    monkeypatch.setattr(kv_sizing, "profile_device_memory", lambda *args, **kwargs: measured)
    monkeypatch.setattr(kv_sizing, "check_room", lambda memory, kv_bytes, device: checked.append(kv_bytes))

    size = kv_cache_size(loaded, settings(gpu_memory_utilization=0.5), dtype=torch.float32, device=CUDA)

    page_bytes = bytes_per_page(loaded)
    assert size.num_pages == measured.kv_bytes() // page_bytes
    assert checked == [size.num_pages * page_bytes]
    assert str(size).startswith(f"{(size.num_pages - 1) * 16:,} tokens (")
    assert str(size).endswith(f"= {measured.describe()}")


def test_a_small_models_cache_stops_at_the_pages_the_kernels_address(loaded, monkeypatch):
    monkeypatch.setattr(kv_sizing, "profile_device_memory", lambda *args, **kwargs: memory(total=400 * GiB))
    monkeypatch.setattr(kv_sizing, "check_room", lambda memory, kv_bytes, device: None)

    size = kv_cache_size(loaded, settings(gpu_memory_utilization=0.5), dtype=torch.float32, device=CUDA)

    head_elements_per_page = 16 * loaded.config.head_dim
    assert size.num_pages * head_elements_per_page <= 2**31 - 1 < (size.num_pages + 1) * head_elements_per_page
    assert "the attention kernels address no more pages" in str(size)


def test_a_budget_of_less_than_two_pages_is_refused(loaded, monkeypatch):
    page_bytes = bytes_per_page(loaded)
    tight = memory(
        total=100 * page_bytes, utilization=1.0, weights=0, activations=0, cuda_graphs=0, non_torch=99 * page_bytes
    )
    monkeypatch.setattr(kv_sizing, "profile_device_memory", lambda *args, **kwargs: tight)

    with pytest.raises(ValueError, match="gpu_memory_utilization=1 .*less than two pages"):
        kv_cache_size(loaded, settings(gpu_memory_utilization=1.0), dtype=torch.float32, device=CUDA)


def _not_on_this_device(*args, **kwargs):
    raise AssertionError("the device was profiled")
