"""The engine on a CUDA device (run on the accelerator machine: `pytest -m gpu`)."""

import pytest
import torch

from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS
from tests.workers.engine.hf_reference import TINY_CONFIGS, build_hf_model
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_float32_greedy_matches_hf_on_cuda(name, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_model = build_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, device="cuda", dtype="float32", kv_cache_bytes=1 << 26, max_num_batched_tokens=32)
    prompts = [[3, 14, 15, 92, 65], list(range(40, 100))]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    hf_model = hf_model.cuda()
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            reference = hf_model.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert result.token_ids == reference


def test_bfloat16_batch_with_preemption_completes_on_cuda():
    llm = LLM(TINY_CONFIGS["llama"], device="cuda", seed=0, num_pages=14)
    prompts = [[i % 128 for i in range(start, start + 40)] for start in range(6)]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert all(len(r.token_ids) == 40 for r in results)
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize(
    "config", [TINY_CONFIGS["llama"], TINY_MOE_CONFIGS["deepseek_v3"]], ids=["llama", "deepseek_v3 (MLA)"]
)
def test_cuda_graphs_and_async_scheduling_on_or_off_give_the_same_tokens(config):
    """Greedy and seeded rows, stop tokens, max_tokens, an abort, prefix hits and preemption."""
    from tests.workers.engine.workloads import ABORTED, mixed_requests, run_mixed

    results = {}
    for eager in (False, True):
        for async_scheduling in (False, True):
            engine = LLM(
                config,
                device="cuda",
                dtype="float32",
                seed=0,
                num_pages=40,
                enforce_eager=eager,
                async_scheduling=async_scheduling,
            ).engine
            assert (engine.runner.graphs is None) == eager
            results[eager, async_scheduling] = run_mixed(engine, mixed_requests(128, count=24, seed=1))
            assert engine.stats().num_preemptions > 0
    reference = results[True, False]
    assert all(result == reference for result in results.values())
    assert reference[ABORTED][1] == "abort"


def test_seeded_sampling_on_cuda_is_reproducible_and_batch_invariant():
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(TINY_CONFIGS["llama"], device="cuda", dtype="float32", seed=0)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = list(range(10, 40))
    alone = llm.generate([prompt], params)[0].token_ids
    others = [[(i * 7 + j) % 128 for j in range(5 + i % 17)] for i in range(63)]
    batch = [prompt] + others
    batched = llm.generate(
        batch, [params] + [SamplingParams(temperature=0.7, seed=i, max_tokens=24) for i in range(63)]
    )
    assert batched[0].token_ids == alone
    assert llm.generate([prompt], params)[0].token_ids == alone


def test_float32_greedy_on_triton_follows_the_torch_reference_backend():
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[(i * 13 + j) % 128 for j in range(3 + i * 5)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for backend in ("triton", "torch_sdpa"):
        # Two engines are alive at once as the loop goes round: each takes a share of the device.
        llm = LLM(
            TINY_CONFIGS["qwen2_bias_sliding"],
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            gpu_memory_utilization=0.4,
        )
        results[backend] = [r.token_ids for r in llm.generate(prompts, params)]
    assert results["triton"] == results["torch_sdpa"]


def test_bfloat16_smollm2_shape_decodes_with_graphs():
    """The benchmark's model shape (random weights): graphs and eager agree at batch 1 and 48."""
    from bench.smollm2_config import SMOLLM2_135M_CONFIG

    config = {**SMOLLM2_135M_CONFIG, "num_hidden_layers": 4}
    prompts = [[(i * 31 + j) % 49152 for j in range(100 + i)] for i in range(48)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        # Two engines are alive at once as the loop goes round: each takes a share of the device.
        llm = LLM(config, device="cuda", seed=0, max_num_seqs=64, enforce_eager=eager, gpu_memory_utilization=0.4)
        outputs[eager] = [r.token_ids for r in llm.generate(prompts, params)]
        outputs[(eager, 1)] = llm.generate(prompts[:1], params)[0].token_ids
    assert outputs[(False, 1)] == outputs[(True, 1)]
    # bf16 rounding can flip a near-tie between the two paths; the sequences must still agree mostly.
    same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    assert same >= 40


def test_a_long_prompt_prepared_ahead_of_a_busy_device_keeps_its_inputs():
    """A long prompt's chunks sample nothing, so the host launches them back to back without waiting
    for the device. With the device held back by a long kernel, a chunk's inputs are copied only after
    the host prepared later chunks: those must not overwrite inputs still to be copied (served on an
    H100, this crashed the worker after bursts, on an 8k prompt: embedding indices out of bounds)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = [(i * 7 + 3) % 128 for i in range(240)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for held_back in (False, True):
        engine = LLM(
            TINY_CONFIGS["llama"],
            device="cuda",
            dtype="float32",
            seed=0,
            max_num_batched_tokens=16,
            kv_cache_bytes=1 << 26,
        ).engine
        engine.add_request(EngineRequest(request_id="long", prompt_token_ids=prompt, params=params))
        torch.cuda.synchronize()
        if held_back:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time queued before the first chunk
        out = []
        while engine.has_unfinished():
            out += [token for delta in engine.step() for token in delta.token_ids]
            if not held_back:
                torch.cuda.synchronize()
        tokens[held_back] = out
    assert len(tokens[False]) == 8
    assert tokens[True] == tokens[False]
