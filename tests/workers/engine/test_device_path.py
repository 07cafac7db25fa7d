"""The engine's device path (Triton attention, fused ops, persistent input batch, on-device sampling)
on the CPU, under Triton's interpreter: the same tokens as the torch reference path."""

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import add_constrained
from tests.workers.engine.test_constraints_and_prompt_logprobs import ScriptConstraint
from tests.workers.engine.workloads import ABORTED, mixed_requests, run_mixed
from workers.engine import LLM, SamplingParams
from workers.kvstore.block_files import BlockFiles
from workers.protocol.engine_request import EngineRequest

pytest.importorskip("triton")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs this in test_cuda")


def engines(name: str, async_scheduling: bool = True, **kwargs):
    reference = LLM(TINY_CONFIGS[name], seed=0, max_num_batched_tokens=32, **kwargs).engine
    device = LLM(
        TINY_CONFIGS[name],
        seed=0,
        max_num_batched_tokens=32,
        attention_backend="triton",
        async_scheduling=async_scheduling,
        **kwargs,
    ).engine
    return reference, device


@CPU_ONLY
@pytest.mark.parametrize("name", ["llama", "qwen3_qknorm_layer_types"])
def test_device_path_gives_the_reference_tokens(name):
    reference, device = engines(name, kv_cache_bytes=1 << 22)
    requests = mixed_requests(128, count=6, max_new=(3, 9))
    expected = run_mixed(reference, requests)
    got = run_mixed(device, requests)
    assert got == expected
    assert got[ABORTED][1] == "abort"


@CPU_ONLY
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_device_path_survives_preemption_with_the_same_tokens(async_scheduling):
    reference, device = engines("llama", num_pages=9, async_scheduling=async_scheduling)
    requests = mixed_requests(128, count=5, seed=3, max_new=(4, 12))
    expected = run_mixed(reference, requests)
    got = run_mixed(device, requests)
    assert device.stats().num_preemptions > 0
    assert got == expected


EXTRAS = {
    "logprobs": SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
    "presence": SamplingParams(temperature=0.0, max_tokens=7, presence_penalty=1.5, frequency_penalty=0.5),
    "repetition": SamplingParams(temperature=0.0, max_tokens=7, repetition_penalty=1.8, ignore_eos=True),
    "bias": SamplingParams(temperature=0.0, max_tokens=5, logit_bias={7: 30.0, 9: -100.0}, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=8, presence_penalty=0.7, logprobs=1),
    "plain": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
}


@CPU_ONLY
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_device_sampling_extras_give_the_host_samplers_tokens_and_logprobs(async_scheduling):
    """Bias, penalties, logprobs and a constraint's mask on the device, batched with plain rows,
    equal the host Sampler's results on the reference path."""
    reference, device = engines("llama", async_scheduling=async_scheduling, kv_cache_bytes=1 << 22)
    got = {}
    for engine in (reference, device):
        for index, (name, params) in enumerate(EXTRAS.items()):
            engine.add_request(
                EngineRequest(request_id=name, prompt_token_ids=list(range(5 + index, 25 + index)), params=params)
            )
        add_constrained(
            engine,
            EngineRequest(request_id="masked", prompt_token_ids=list(range(40, 52)), params=EXTRAS["plain"]),
            ScriptConstraint([3, 1, 4, 1, 5]),
        )
        deltas = []
        while engine.has_unfinished():
            deltas.extend(engine.step())
        got[engine is device] = {
            delta.request_id: (
                [t for d in deltas if d.request_id == delta.request_id for t in d.token_ids],
                [lp for d in deltas if d.request_id == delta.request_id for lp in d.logprobs],
            )
            for delta in deltas
        }
    # The device path's kernels round differently from the torch reference: logprob values agree to
    # float32 rounding, everything else exactly.
    assert got[True].keys() == got[False].keys()
    for name, (tokens, logprobs) in got[True].items():
        expected_tokens, expected_logprobs = got[False][name]
        assert tokens == expected_tokens, name
        assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in logprobs] == [
            (lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in expected_logprobs
        ], name
        values = [v for lp in logprobs for v in (lp.logprob, *(v for _, v in lp.top))]
        expected_values = [v for lp in expected_logprobs for v in (lp.logprob, *(v for _, v in lp.top))]
        assert values == pytest.approx(expected_values, rel=1e-5), name
    assert got[True]["masked"][0] == [3, 1, 4, 1, 5]
    assert got[True]["bias"][0] == [7] * 5
    assert [len(lp.top) for lp in got[True]["logprobs"][1]] == [3] * 6


def test_unknown_and_unsupported_backends_fail_at_start_naming_the_setting():
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(TINY_CONFIGS["llama"], attention_backend="flash")


def test_a_head_dim_the_triton_kernels_lack_fails_at_start_naming_the_setting():
    config = {**TINY_CONFIGS["llama"], "hidden_size": 48, "head_dim": 12}
    with pytest.raises(ValueError, match="attention_backend='triton'.*head_dim"):
        LLM(config, attention_backend="triton")


@CPU_ONLY
def test_async_steps_with_a_kv_store_store_the_blocks_synchronous_steps_store(tmp_path):
    """A block whose last token is still pending is stored a step later; steps keep overlapping."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for async_scheduling in (True, False):
        store_dir = tmp_path / f"async-{async_scheduling}"
        llm = LLM(
            TINY_CONFIGS["llama"],
            seed=0,
            attention_backend="triton",
            async_scheduling=async_scheduling,
            kv_store=store_dir,
            kv_block_tokens=32,
        )
        engine = llm.engine
        engine.add_request(EngineRequest(request_id="x", prompt_token_ids=list(range(3, 43)), params=params))
        tokens, overlapped = [], False
        while engine.has_unfinished():
            tokens += [t for delta in engine.step() for t in delta.token_ids]
            overlapped |= engine._in_flight is not None
        llm.close()
        files = BlockFiles(store_dir)
        blocks = {key: bytes(files.read(key)) for key, *_ in files.scan()}
        results[async_scheduling] = (tokens, blocks, overlapped)
    assert results[True][2] and not results[False][2]
    assert results[True][0] == results[False][0]
    # 40 prompt + 40 output tokens: blocks of 32 at 0-31 and 32-63, the second one mostly output.
    assert len(results[True][1]) >= 2 and results[True][1] == results[False][1]
